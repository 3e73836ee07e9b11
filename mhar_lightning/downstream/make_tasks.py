"""Write the shipped task files: `python -m mhar_lightning.downstream.make_tasks [OUT_DIR]`.

Every example is generated here from facts of Python's grammar and of arithmetic, with identifiers from the word lists
below and a fixed seed, so the files are the kit's own text and the same on every run (a test regenerates them):

- `python-keywords`: a statement cut before a keyword or colon (`for item in`, `except KeyError as`, `from os
  import`, `lambda x:`); the distractors are what other languages write there (`of`, `include`, `=>`, `then`), which
  Python's grammar does not allow, or (after `is not`) other languages' names for `None`.
- `python-brackets`: an expression with two to four nested brackets left open; the choices close them in every
  order, only one of which is Python.
- `arithmetic`: `a + b =`, `a - b =` and `a * b =` with small numbers; the distractors are off by one, by ten, or
  the result of another operation.
"""

import json
import random
import sys
from collections.abc import Callable
from itertools import permutations
from pathlib import Path

from mhar_lightning.downstream.tasks import SHIPPED, TASK_DIR, Example

SEED, EXAMPLES = 0, 200
NAMES = ("count", "items", "value", "name", "path", "data", "result", "key", "line", "text", "index", "size", "node")
CALLS = ("len", "sorted", "list", "str", "max", "min", "print", "tuple", "set", "repr")
ERRORS = ("ValueError", "KeyError", "OSError", "TypeError", "IndexError", "RuntimeError", "AttributeError")
MODULES = ("os", "sys", "json", "re", "math", "itertools", "functools", "pathlib", "collections", "typing")
CLOSE = {"(": ")", "[": "]", "{": "}"}


def keyword_example(rng: random.Random) -> Example:
    """A statement whose next word Python's grammar fixes, against words it does not allow there."""
    a, b = rng.sample(NAMES, 2)
    templates: list[tuple[str, str, tuple[str, ...]]] = [
        (f"for {a} in {b}s:\n    pass\nfor {a}", " in", (" of", " on", " from")),
        (f"try:\n    {a} = {b}[0]\nexcept {rng.choice(ERRORS)}", " as", (" to", " with", " =")),
        (f"from {rng.choice(MODULES)}", " import", (" include", " require", " using")),
        (f"{a} = lambda {b}", ":", (" =>", " ->", " {")),
        (f"with open({a})", " as", (" to", " =", " ->")),
        (f"if {a} is not", " None", (" null", " nil", " undefined")),
        (f"{a} = [{b} for {b}", " in", (" of", " over", " at")),
        (f"def {a}({b})", ":", (" {", " =>", " do")),
        (f"while {a}", ":", (" do", " then", " {")),
        (f"{a} = {b} if {b}", " else", (" otherwise", " elif", " :")),
    ]
    context, answer, wrong = rng.choice(templates)
    return shuffled(rng, context, answer, list(wrong))


def bracket_example(rng: random.Random) -> Example:
    """`name = call(x[key({...` with 2-4 brackets open; choices close them in every distinct order."""
    depth = rng.randint(2, 4)
    opens = [rng.choice("([{") for _ in range(depth)]
    if len(set(opens)) == 1:  # one kind only: every order would be the same string
        opens[rng.randrange(depth)] = "[" if opens[0] != "[" else "("
    parts = [f"{rng.choice(NAMES)} = "]
    for bracket in opens:
        parts.append({"(": rng.choice(CALLS) + "(", "[": rng.choice(NAMES) + "[", "{": "{"}[bracket])
    parts.append(rng.choice(NAMES))
    answer = "".join(CLOSE[b] for b in reversed(opens))
    orders = sorted({"".join(p) for p in permutations(answer)} - {answer})
    return shuffled(rng, "".join(parts), answer, rng.sample(orders, min(3, len(orders))))


def arithmetic_example(rng: random.Random) -> Example:
    """`a op b =` with the result and three wrong results of the same kind."""
    op = rng.choice("+-*")
    a, b = (rng.randint(2, 12), rng.randint(2, 12)) if op == "*" else sorted(rng.sample(range(1, 100), 2))[::-1]
    result = {"+": a + b, "-": a - b, "*": a * b}[op]
    near = {result + 1, result - 1, result + 10, result - 10, a + b, a - b, a * b} - {result}
    wrong = rng.sample(sorted(near), 3)
    return shuffled(rng, f"{a} {op} {b} =", f" {result}", [f" {w}" for w in wrong])


def shuffled(rng: random.Random, context: str, answer: str, wrong: list[str]) -> Example:
    choices = [answer, *wrong]
    rng.shuffle(choices)
    return Example(context, tuple(choices), choices.index(answer))


MAKERS: dict[str, Callable[[random.Random], Example]] = {
    "python-keywords": keyword_example,
    "python-brackets": bracket_example,
    "arithmetic": arithmetic_example,
}


def task_lines(name: str) -> str:
    """The JSONL text of shipped task `name`."""
    rng = random.Random(f"{name}:{SEED}")
    examples = [MAKERS[name](rng) for _ in range(EXAMPLES)]
    return "".join(
        json.dumps({"context": e.context, "choices": list(e.choices), "answer": e.answer}) + "\n" for e in examples
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    out = Path(args[0]) if args else TASK_DIR
    out.mkdir(parents=True, exist_ok=True)
    for name in SHIPPED:
        (out / f"{name}.jsonl").write_text(task_lines(name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
