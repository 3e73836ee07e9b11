"""Multiple-choice task files: the ones the kit ships and the user's own JSONL."""

import json
from dataclasses import dataclass
from pathlib import Path

TASK_DIR = Path(__file__).parent / "tasks"
SHIPPED = ("python-keywords", "python-brackets", "arithmetic")
"""Task files installed with the kit (`tasks/<name>.jsonl`; how each was made: `make_tasks`)."""


@dataclass(frozen=True)
class Example:
    """A context and its candidate continuations; `answer` indexes the right one."""

    context: str
    choices: tuple[str, ...]
    answer: int


@dataclass(frozen=True)
class Task:
    name: str
    examples: tuple[Example, ...]


def parse_example(line: str, where: str) -> Example:
    """One JSONL line as an `Example`; a one-line error naming the file, the line and the fix otherwise."""
    try:
        raw = json.loads(line)
        example = Example(str(raw["context"]), tuple(str(c) for c in raw["choices"]), int(raw["answer"]))
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f'{where}: {error!r}; each line needs {{"context": str, "choices": [str, ...], "answer": int}}'
        ) from None
    if len(example.choices) < 2 or not 0 <= example.answer < len(example.choices):
        raise ValueError(f"{where}: needs at least 2 choices and an answer index among them")
    return example


def load_task(spec: str | Path, max_examples: int | None = None) -> Task:
    """A shipped task by name, or a JSONL file by path (its stem names it); the first `max_examples` examples."""
    path = TASK_DIR / f"{spec}.jsonl" if str(spec) in SHIPPED else Path(spec)
    if not path.is_file():
        raise ValueError(f"downstream task {str(spec)!r} is neither a shipped task ({', '.join(SHIPPED)}) nor a file")
    lines = [line for line in path.read_text().splitlines() if line.strip()][:max_examples]
    examples = tuple(parse_example(line, f"{path}:{i + 1}") for i, line in enumerate(lines))
    if not examples:
        raise ValueError(f"downstream task file {path} holds no examples")
    return Task(path.stem, examples)
