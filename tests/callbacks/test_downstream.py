"""`DownstreamTasks` through `mhar fit`: per-task accuracy at each validation equals the task scored on the saved
weights, and `mhar compare`'s result reader and report carry it with the validation's bits per byte."""

import json

import pytest
from cli_helpers import NO_PROBES, fast_demo_args, scalars
from eval_helpers import tiny_corpus
from mhar_lightning.callbacks import DownstreamTasks

from mhar_lightning.cli import main as mhar
from mhar_lightning.data.tokenizer import load_tokenizer
from mhar_lightning.downstream import load_task, task_accuracy
from mhar_lightning.eval.loading import load_model
from mhar_lightning.study.report import markdown, summarize
from mhar_lightning.study.results import read_run


def test_fit_logs_task_accuracy_and_compare_reads_it_with_bits_per_byte(tmp_path):
    mine = tmp_path / "mine.jsonl"
    mine.write_text(
        "".join(
            json.dumps({"context": f"def f{i}(a, b):\n    return a", "choices": [" + b", " ++ b", " b +"], "answer": 0})
            + "\n"
            for i in range(6)
        )
    )
    callbacks = [
        *json.loads(NO_PROBES[1]),
        {"class_path": "mhar_lightning.callbacks.DownstreamTasks",
         "init_args": {"tasks": [str(mine), "arithmetic"], "max_examples": 12, "batch_size": 8}},
    ]  # fmt: skip
    root = tmp_path / "run"
    args = [*fast_demo_args(root, 3), "--trainer.callbacks", json.dumps(callbacks)]
    try:
        mhar([*args, "--data.path", str(tiny_corpus(tmp_path / "data"))])
    except SystemExit as exit_:
        assert not exit_.code, f"mhar fit exited with {exit_.code}"

    model = load_model(root / "checkpoints" / "last.ckpt", device="cpu").model
    logged = {}
    for task in (load_task(mine), load_task("arithmetic", 12)):
        values = scalars(root, f"downstream/{task.name}/acc")
        assert list(values) == [2]  # the validation after step 3 (logged at the steps done before its batch)
        assert values[2] == pytest.approx(task_accuracy(model, load_tokenizer("byte"), task, 3, 64), abs=1e-7)
        logged[task.name] = values[2]
    assert list(scalars(root, "downstream/seconds")) == [2]
    (bpb,) = scalars(root, "val/bpb").values()

    result = read_run(root, "mhar", 0, "demo")
    assert result.val_bpb == pytest.approx(bpb, abs=1e-7) and result.downstream == pytest.approx(logged, abs=1e-7)
    report = markdown([result], summarize([result], "mhar"), "mhar", [])
    assert f"| {bpb:.4f} |" in report.split("## Summary")[1].split("##")[0]
    downstream = report.split("## Downstream accuracy")[1].splitlines()
    assert "| variant | arithmetic | mine |" in downstream
    assert f"| mhar | {logged['arithmetic']:.3f} | {logged['mine']:.3f} |" in downstream


def test_bad_arguments_are_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="batch_size and every_n_validations must be >= 1"):
        DownstreamTasks(batch_size=0)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "arithmetic.jsonl").write_text(json.dumps({"context": "1 =", "choices": ["1", "2"], "answer": 0}))
    with pytest.raises(ValueError, match="share a name; give each file its own name"):
        DownstreamTasks(tasks=["arithmetic", str(tmp_path / "a" / "arithmetic.jsonl")])


def test_a_missing_task_file_is_refused_by_mhar_fit_in_one_line(tmp_path, capsys):
    flags = ["--trainer.callbacks+=mhar_lightning.callbacks.DownstreamTasks", "--trainer.callbacks.tasks", "[no.jsonl]"]
    with pytest.raises(SystemExit) as done:
        mhar([*fast_demo_args(tmp_path, 1), *flags])
    assert done.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "mhar: error: downstream task 'no.jsonl' is neither a shipped task (python-keywords, python-brackets,"
        " arithmetic) nor a file"
    )
    assert not (tmp_path / "checkpoints").exists()
