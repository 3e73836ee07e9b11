"""The shipped task files are what their generator writes, well formed, with one right answer each; a user's file
loads by path and bad lines are refused in one line naming the fix."""

import json

import pytest

from mhar_lightning.downstream import SHIPPED, load_task
from mhar_lightning.downstream.make_tasks import main as make_tasks
from mhar_lightning.downstream.tasks import TASK_DIR


def test_the_shipped_files_are_what_the_generator_writes(tmp_path):
    assert make_tasks([str(tmp_path)]) == 0
    for name in SHIPPED:
        assert (tmp_path / f"{name}.jsonl").read_bytes() == (TASK_DIR / f"{name}.jsonl").read_bytes(), name


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_example_has_distinct_choices_and_one_answer(name):
    task = load_task(name)
    assert task.name == name and len(task.examples) == 200
    for example in task.examples:
        assert len(set(example.choices)) == len(example.choices) >= 2
    answers = [example.answer for example in task.examples]
    assert len(set(answers)) > 1  # the right answer is not always in one place


def test_arithmetic_answers_are_right_and_brackets_close_in_order():
    for example in load_task("arithmetic").examples:
        a, op, b, _ = example.context.split()
        assert int(example.choices[example.answer]) == {"+": int(a) + int(b), "-": int(a) - int(b)}.get(
            op, int(a) * int(b)
        )
    for example in load_task("python-brackets").examples:
        for i, choice in enumerate(example.choices):
            try:
                compile(example.context + choice, "<task>", "exec")
                valid = True
            except SyntaxError:
                valid = False
            assert valid == (i == example.answer), example


def test_a_users_file_loads_by_path_and_bad_lines_are_refused(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"context": "1 + 1 =", "choices": [" 2", " 3"], "answer": 0}) + "\n\n")
    task = load_task(path)
    assert task.name == "mine" and [e.choices for e in task.examples] == [(" 2", " 3")]
    path.write_text(json.dumps({"context": "x", "choices": ["a", "b"]}) + "\n")
    with pytest.raises(ValueError, match=r'mine.jsonl:1: KeyError.*each line needs \{"context": str'):
        load_task(path)
    path.write_text(json.dumps({"context": "x", "choices": ["a", "b"], "answer": 2}) + "\n")
    with pytest.raises(ValueError, match="mine.jsonl:1: needs at least 2 choices and an answer index among them"):
        load_task(path)
    with pytest.raises(ValueError, match="'nope' is neither a shipped task .python-keywords, .* nor a file"):
        load_task("nope")
