"""`mhar compare` as a study runner: a 2 x 2 grid on the demo recipe, interrupted, resumed and re-reported."""

import json
import shutil
import signal
import statistics
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import DEMO, corpus_cache, env_with_tests_on_path, scalars
from rich.console import Console

from mhar_lightning.cli import main as mhar
from mhar_lightning.commands import compare as compare_module
from mhar_lightning.commands.compare import STRATEGIES, grid, parse_args
from mhar_lightning.commands.compare import main as compare
from mhar_lightning.convert import load_decoder
from mhar_lightning.module import LanguageModel
from mhar_lightning.parallel import routing_parameters
from mhar_lightning.study.continuation import convert_checkpoint
from mhar_lightning.study.grid import CHILDREN, parse_variant, run_dir

FAST = [
    "--trainer.max_steps", "6",
    "--trainer.val_check_interval", "3",
    "--trainer.limit_val_batches", "2",
    "--trainer.log_every_n_steps", "1",
    "--checkpoint.every_n_train_steps", "1",
    "--model.optimizer.warmup_steps", "2",
    "--data.batch_size", "4",
    "--data.seq_len", "32",
    "--data.val_samples", "8",
    "--trainer.callbacks", json.dumps([
        {"class_path": "mhar_lightning.callbacks.TokenThroughputMonitor", "init_args": {"window_size": 2}},
        {"class_path": "mhar_lightning.callbacks.DepthAttentionLogger"},
    ]),
]  # fmt: skip
GRID = ["sum", "mhar-block", "--seeds", "0", "1", "--recipe", str(DEMO)]
STOP = ["--trainer.callbacks+=cli_helpers.StopAtStep", "--trainer.callbacks.step=3"]
pytestmark = pytest.mark.usefixtures("default_corpus")


def final_step(run: Path) -> int:
    return torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"]


def events(run: Path) -> dict[Path, float]:
    """Event files of a run with their modification times (a rerun writes new ones)."""
    return {path: path.stat().st_mtime for path in (run / "tensorboard").rglob("events.*")}


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory, stdlib_cache: Path) -> Path:
    """The grid trained in two calls: one finished run and one interrupted run first, then the rest, two at a time."""
    with corpus_cache(stdlib_cache):
        return _study(tmp_path_factory.mktemp("study"))


def _study(out: Path) -> Path:
    assert compare([*GRID, "--out", str(out), "--time-budget", "1", *FAST]) == 0  # no time for a second run
    finished = run_dir(out, "sum", 0)
    assert (finished / "result.json").is_file() and not run_dir(out, "mhar-block", 0).exists()
    interrupted = run_dir(out, "mhar-block", 0)
    residual = json.dumps({"class_path": "mhar_lightning.residual.MHAR", "init_args": {"heads": 4, "blocks": 4}})
    mhar(["fit", "--config", str(DEMO), "--model.residual", residual, *FAST, "--seed_everything", "0",
          "--trainer.default_root_dir", str(interrupted), *STOP])  # fmt: skip
    before = events(finished)
    assert compare(["--out", str(out), "--jobs", "2", *FAST, *GRID]) == 0  # variants may follow the overrides
    assert events(finished) == before, "a finished run was trained again"
    return out


def test_report_equals_the_runs_logged_values(study: Path) -> None:
    results = json.loads((study / "results.json").read_text())
    assert [(r["variant"], r["seed"]) for r in results["runs"]] == [
        ("sum", 0), ("mhar-block", 0), ("sum", 1), ("mhar-block", 1)
    ]  # fmt: skip
    logged = {}
    for run in results["runs"]:
        folder = run_dir(study, run["variant"], run["seed"])
        val = scalars(folder, "val/loss")  # TensorBoard steps: optimizer steps done before the logging batch
        assert sorted(val) == [2, 5] and run["val_step"] == run["steps"] == 6 == final_step(folder)
        assert run["val_loss"] == pytest.approx(val[5], abs=1e-7)
        assert run["tokens_per_step"] == 4 * 32
        assert run["tokens_per_sec"] > 0 and run["peak_memory_gib"] is None  # no GPU memory on CPU
        environment = run["environment"]  # recorded by the run's own `mhar fit`
        assert (environment["device"], environment["world_size"], environment["torch"]) == ("cpu", 1, torch.__version__)
        logged[run["variant"], run["seed"]] = val[5]
    by_name = {v["variant"]: v for v in results["variants"]}
    for name in ("sum", "mhar-block"):
        losses = [logged[name, 0], logged[name, 1]]
        assert by_name[name]["val_loss"] == pytest.approx(statistics.fmean(losses), abs=1e-7)
        assert by_name[name]["val_loss_sd"] == pytest.approx(statistics.stdev(losses), abs=1e-7)
    gaps = [logged["mhar-block", s] - logged["sum", s] for s in (0, 1)]
    assert by_name["mhar-block"]["gap"] == pytest.approx(statistics.fmean(gaps), abs=1e-7)
    assert by_name["sum"]["routing_params"] == 0 < by_name["mhar-block"]["routing_params"]
    assert [r["shared"] for r in results["runs"]] == [1, 2, 2, 2]  # sum seed 0 alone, then two at a time
    alone = results["runs"][0]["tokens_per_sec"]  # speeds are those of the runs that trained alone
    assert by_name["sum"]["tokens_per_sec"] == alone and by_name["sum"]["speed_ratio"] == 1.0
    assert by_name["mhar-block"]["tokens_per_sec"] is None and by_name["mhar-block"]["speed_ratio"] is None
    text = (study / "report.md").read_text()
    assert "Runs trained 2 at a time (`--jobs`) shared their machine" in text
    assert f"| cpu | 1 | {results['runs'][0]['environment']['mhar-lightning']} | {torch.__version__} |" in text
    assert f"{statistics.fmean(gaps):+.4f} ± {statistics.stdev(gaps):.4f}" in text
    for value in logged.values():
        assert f"| {value:.4f} |" in text
    for png in ("loss.png", "depth_mhar-block.png"):
        assert (study / png).stat().st_size > 5000
    assert not (study / "depth_sum.png").exists()


def test_interrupted_run_resumed_from_its_last_checkpoint(study: Path) -> None:
    run = run_dir(study, "mhar-block", 0)
    first, second = (scalars(run, "train/loss", version) for version in (0, 1))
    assert max(first) == 2 and min(second) == 3 and max(second) == 5  # steps 1-3, then 4-6


def test_rerun_and_report_only_rebuild_the_same_report(study: Path, tmp_path: Path) -> None:
    report = (study / "report.md").read_text()
    assert compare([*GRID, "--out", str(study), *FAST]) == 0  # everything finished: nothing trains
    assert (study / "report.md").read_text() == report
    copy = tmp_path / "copy"
    shutil.copytree(study, copy)
    (copy / "report.md").unlink()
    (copy / "results.json").unlink()
    assert compare(["--report-only", str(copy)]) == 0  # the runs found in the folder, re-read from their logs
    assert (copy / "report.md").read_text() == report
    for config in copy.glob("runs/*/*/tensorboard/version_*/config.yaml"):  # logs copied in part: result files read
        config.unlink()
    assert compare(["--report-only", str(copy)]) == 0
    assert (copy / "report.md").read_text() == report
    for logs in copy.glob("runs/*/*/tensorboard"):  # the committed result files alone are enough
        shutil.rmtree(logs)
    assert compare([*GRID, "--out", str(copy), "--report-only", *FAST]) == 0
    assert (copy / "report.md").read_text() == report


def test_a_study_grown_by_a_later_call_keeps_its_baseline_and_reports_every_run(study: Path, tmp_path: Path) -> None:
    grown = tmp_path / "grown"
    shutil.copytree(study, grown)
    variant = "mhar-h2=mhar:heads=2,blocks=4"
    assert compare([variant, "--recipe", str(DEMO), "--out", str(grown), "--max-runs", "0", *FAST]) == 0
    results = json.loads((grown / "results.json").read_text())
    assert results["baseline"] == "sum" and [v["variant"] for v in results["variants"]] == ["sum", "mhar-block"]
    assert len(results["runs"]) == 4  # the earlier call's runs; the new variant has none yet
    assert json.loads((grown / "study.json").read_text())["variants"] == ["sum", "mhar-block", "mhar-h2"]


def test_a_study_refuses_other_arguments_for_its_runs(study: Path, capsys) -> None:
    assert compare([*GRID, "--out", str(study), *FAST, "--trainer.max_steps", "8"]) == 2
    assert "was started as" in capsys.readouterr().err
    assert json.loads((run_dir(study, "sum", 0) / "result.json").read_text())["steps"] == 6


def test_a_kit_recipe_names_a_run_the_same_from_any_directory_and_checkout(tmp_path: Path, monkeypatch) -> None:
    variant = parse_variant("mhar:heads=2", DEMO, STRATEGIES)
    monkeypatch.chdir(DEMO.parent)
    inside = variant.describe()
    monkeypatch.chdir(tmp_path)
    assert variant.describe() == inside
    assert inside.startswith("recipes/demo.yaml + residual ")
    other = tmp_path / "elsewhere" / "recipes"
    shutil.copytree(DEMO.parent, other)
    assert parse_variant("mhar:heads=2", other / DEMO.name, STRATEGIES).describe() == inside


def test_variants_seeds_and_overrides_in_any_order(capsys) -> None:
    argv = ["--seeds", "0", "1", "sum", "--out", "x", "--trainer.max_steps", "3", "mhar", "--jobs", "2", "attnres"]
    args, overrides = parse_args(argv)
    assert (args.variants, args.seeds, args.jobs, overrides) == (
        ["sum", "mhar", "attnres"],
        [0, 1],
        2,
        ["--trainer.max_steps", "3"],
    )
    with pytest.raises(SystemExit):
        parse_args(["sum", "--seeds", "one"])
    assert "argument --seeds: expected at least one argument" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["mhra"], "unknown variant 'mhra': use a recipe"),
        (["sum", "--only", "mhar"], "no variant named 'mhar'; the variants are sum"),
        (["sum", "sum"], "variant names repeat"),
        (["mhar:heads"], "write arguments as key=value"),
        *[([f"{name}=sum"], f"variant name {name!r} in '{name}=sum' is not a plain name: use letters, digits, '.',"
           " '_' and '-' (not '.' or '..' alone), e.g. mhar-h2=mhar:heads=2") for name in ("..", ".", "/", "", "a b")],
    ],
)  # fmt: skip
def test_bad_grids_are_one_line_errors(args: list[str], message: str, tmp_path: Path, capsys) -> None:
    out = tmp_path / "study"
    assert compare([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err
    assert not out.exists()


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        (["--max-runs", "-1"], "--max-runs -1: pass 0 or more runs to train in this call"),
        (["--jobs", "0"], "--jobs 0: train at least one run at a time"),
        (["--time-budget", "0"], "--time-budget 0: pass the seconds this call may train, more than 0"),
    ],
)
def test_limits_out_of_range_are_refused(flag: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_args(["sum", *flag])
    assert exit_.value.code == 2 and capsys.readouterr().err.strip().endswith(f"mhar compare: error: {message}")


def test_report_only_of_a_missing_folder_is_refused(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "missing"
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--report-only", str(missing)])
    assert exit_.value.code == 2 and capsys.readouterr().err.strip().endswith(
        f"mhar compare: error: --report-only {missing}: no such folder; pass the --out folder of an earlier"
        " `mhar compare`"
    )
    assert not missing.exists()


def test_runs_that_would_not_validate_their_final_weights_are_refused_before_training(tmp_path: Path, capsys) -> None:
    assert compare(["sum", "--seeds", "0", "--out", str(tmp_path), "--trainer.max_steps", "2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "mhar compare: error: sum: trainer.val_check_interval=150 does not divide trainer.max_steps=2, so the run"
        " would not validate its final weights: pass --trainer.val_check_interval N, N a divisor of 2"
    )
    assert not (tmp_path / "runs").exists()  # nothing trained, no run recorded: the suggested flag is accepted next


def test_a_run_stopped_before_its_max_steps_is_not_finished_and_resumes(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("PYTHONPATH", env_with_tests_on_path()["PYTHONPATH"])  # the runs import `StopAtStep`
    real_mhar = compare_module.mhar
    monkeypatch.setattr(compare_module, "mhar", lambda args, log: real_mhar([*args, *STOP], log))  # exits 0 at step 3
    argv = ["sum", "--recipe", str(DEMO), "--out", str(tmp_path), *FAST]
    assert compare(argv) == 2
    run = run_dir(tmp_path, "sum", 0)
    assert f"{run} stopped at step 3 of trainer.max_steps=6: the next call resumes it" in capsys.readouterr().out
    assert final_step(run) == 3 and not (run / "result.json").exists()
    (run / "result.json").write_text(json.dumps({"steps": 3}))  # as recorded before runs were checked: not finished
    assert compare([*argv, "--max-runs", "0"]) == 2
    assert "no finished runs" in capsys.readouterr().out  # not reported
    monkeypatch.setattr(compare_module, "mhar", real_mhar)
    assert compare(argv) == 0
    assert json.loads((run / "result.json").read_text())["steps"] == 6 == final_step(run)
    assert min(scalars(run, "train/loss", 1)) == 3  # resumed from step 3


def test_a_failed_run_leaves_the_others_to_train(tmp_path: Path, monkeypatch, capsys) -> None:
    args, overrides = parse_args(["bad=mhar:heads=7", "sum", "--seeds", "0", "1", "--out", str(tmp_path)])
    _, runs = grid(args, overrides)
    trained = []

    def train_run(run, continue_from, jobs, retries) -> int:
        trained.append((run.variant.name, run.seed))
        if run.variant.name == "bad":
            raise RuntimeError("`mhar fit` failed (exit 1)")
        return 0

    monkeypatch.setattr(compare_module, "train_run", train_run)
    failed = compare_module.train(runs, args, Console(width=200))
    assert trained == [("bad", 0), ("sum", 0), ("bad", 1), ("sum", 1)]
    assert failed == ["bad seed 0", "bad seed 1"]
    assert "failed bad seed 1: `mhar fit` failed (exit 1)" in capsys.readouterr().out


def test_a_run_that_crashes_after_its_last_checkpoint_resumes_from_it(tmp_path: Path, monkeypatch, capsys) -> None:
    real_mhar, calls = compare_module.mhar, []

    def crash_at_exit_once(args: list[str], log: Path) -> None:
        calls.append(args)
        real_mhar(args, log)
        if len(calls) == 1:  # trained to the end and saved, then died (a C++ abort at exit, say)
            raise RuntimeError("`mhar fit` failed (exit -6)")

    monkeypatch.setattr(compare_module, "mhar", crash_at_exit_once)
    assert compare(["sum", "--recipe", str(DEMO), "--out", str(tmp_path), *FAST]) == 0
    run = run_dir(tmp_path, "sum", 0)
    assert "--ckpt_path" not in calls[0] and calls[1][-2:] == ["--ckpt_path", "last"]
    assert "(resumed from last.ckpt after 1 failed attempt)" in capsys.readouterr().out
    result = json.loads((run / "result.json").read_text())
    assert result["steps"] == 6 == final_step(run)
    assert result["val_loss"] == pytest.approx(scalars(run, "val/loss")[5], abs=1e-7)  # the final validation


def test_a_run_that_fails_without_saving_is_not_retried(tmp_path: Path, monkeypatch, capsys) -> None:
    calls = []

    def fail(args: list[str], log: Path) -> None:
        calls.append(args)
        raise RuntimeError("`mhar fit` failed (exit 1)")

    monkeypatch.setattr(compare_module, "mhar", fail)
    assert compare(["sum", "--recipe", str(DEMO), "--out", str(tmp_path), "--retries", "3", *FAST]) == 2
    assert len(calls) == 1
    assert "failed sum seed 0: `mhar fit` failed (exit 1)" in capsys.readouterr().out


def test_a_run_killed_by_the_runner_is_not_retried(tmp_path: Path, monkeypatch) -> None:
    calls = []

    def killed_after_saving(args: list[str], log: Path) -> None:
        calls.append(args)
        checkpoint = run_dir(tmp_path, "sum", 0) / "checkpoints" / "last.ckpt"
        checkpoint.parent.mkdir(parents=True, exist_ok=True)
        checkpoint.write_bytes(b"")  # progress was saved, then the runner stopped (SIGTERM, Ctrl-C)
        CHILDREN.kill_all()
        raise RuntimeError("`mhar fit` failed (exit -9)")

    monkeypatch.setattr(compare_module, "mhar", killed_after_saving)
    monkeypatch.setattr(CHILDREN, "stopped", False)  # and back to it after the test, for the runs of later tests
    assert compare(["sum", "--recipe", str(DEMO), "--out", str(tmp_path), *FAST]) == 2
    assert len(calls) == 1
    with (tmp_path / "late.log").open("w") as out:  # nor does anything start after the kill
        assert CHILDREN.run([sys.executable, "-c", "pass"], out) == -signal.SIGKILL


def test_runs_import_the_installed_kit_not_a_folder_of_the_working_directory(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "mhar_lightning").mkdir()  # as in the root of a source checkout with a non-editable install
    (tmp_path / "mhar_lightning" / "__init__.py").write_text("raise ImportError('the folder, not the kit')")
    monkeypatch.chdir(tmp_path)
    with (tmp_path / "out.log").open("w") as out:
        assert CHILDREN.run([sys.executable, "-c", "import mhar_lightning"], out) == 0, (
            tmp_path / "out.log"
        ).read_text()


@pytest.mark.parametrize("target", ["sum", "delta-mhar"])
def test_converted_checkpoint_computes_what_the_run_computed(study: Path, tmp_path: Path, target: str) -> None:
    ckpt = run_dir(study, "sum", 0) / "checkpoints" / "last.ckpt"
    trained = LanguageModel.load_from_checkpoint(ckpt, map_location="cpu").eval()
    converted = load_decoder(convert_checkpoint(ckpt, tmp_path / target, STRATEGIES[target])).eval()
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(converted(tokens), trained(tokens))
    assert (routing_parameters(converted) > 0) == (target == "delta-mhar")


def test_continued_runs_start_from_the_converted_source(study: Path, tmp_path: Path) -> None:
    out = tmp_path / "continued"
    source = run_dir(study, "sum", 0)
    args = ["delta-mhar", "--recipe", str(DEMO), "--continue-from", str(source.parent), "--out", str(out), *FAST]
    assert compare([*args, "--trainer.max_steps", "3"]) == 0
    result = json.loads((run_dir(out, "delta-mhar", 0) / "result.json").read_text())
    assert result["initial_val_loss"] == pytest.approx(scalars(source, "val/loss")[5], abs=1e-6)
    assert result["steps"] == 3 and result["routing_params"] > 0
    assert "## Starting point of continued runs" in (out / "report.md").read_text()
