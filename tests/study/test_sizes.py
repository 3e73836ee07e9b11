"""The gap against model size: gaps paired by seed within each study, one column per study, through
`mhar compare --sizes`."""

from pathlib import Path

import pytest

from mhar_lightning.commands.compare import main
from mhar_lightning.study.report import summarize, write
from mhar_lightning.study.results import RunResult


def run(variant: str, seed: int, val_loss: float, params: int) -> RunResult:
    return RunResult(
        variant=variant, seed=seed, definition=variant, steps=10, tokens_per_step=8, params=params, routing_params=0,
        val_loss=val_loss, val_step=10, val_curve=[(10, val_loss)], train_curve=[(10, val_loss)],
        tokens_per_sec=None, peak_memory_gib=None,
    )  # fmt: skip


def study(folder: Path, params: int, losses: dict[str, list[float]]) -> Path:
    runs = [run(v, seed, loss, params) for v, seeds in losses.items() for seed, loss in enumerate(seeds)]
    folder.mkdir()
    write(folder, runs, summarize(runs, "sum"), "sum", [])
    return folder


def test_gaps_are_paired_by_seed_within_each_study(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    small = study(tmp_path / "6m", 6_000_000, {"sum": [1.0, 2.0], "mhar": [1.1, 2.1], "hc": [0.9, 1.9]})
    large = study(tmp_path / "100m", 114_000_000, {"sum": [3.0, 3.5, 4.0], "mhar": [2.9, 3.3]})
    assert main(["--sizes", str(small), str(large), "--out", str(tmp_path / "out")]) == 0
    table = (tmp_path / "out" / "gap_vs_size.md").read_text().splitlines()
    assert table[0] == "| variant | 6m (6.0 M) | 100m (114.0 M) |"
    assert table[2] == "| mhar | +0.1000 ± 0.0000 (2) | -0.1500 ± 0.0707 (2) |"
    assert table[3] == "| hc | -0.1000 ± 0.0000 (2) |  |"
    assert (tmp_path / "out" / "gap_vs_size.png").stat().st_size > 0
    assert "gap_vs_size.png" in capsys.readouterr().out


def test_a_folder_without_a_report_is_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "empty").mkdir()
    assert main(["--sizes", str(tmp_path / "empty"), "--out", str(tmp_path / "out")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.endswith(
        "results.json does not exist: run `mhar compare --report-only " + str(tmp_path / "empty") + "` first"
    )
    assert not (tmp_path / "out").exists()
