"""The study report: speeds and speed ratios only of runs that had their machine to themselves; runs whose
validation is far above their training loss named; the devices and versions the runs trained with."""

import io
from dataclasses import replace

import pytest
from rich.console import Console

from mhar_lightning.study.report import console_tables, markdown, summarize, summary_rows, suspect_runs
from mhar_lightning.study.results import RunResult


def run(variant: str, seed: int, tokens_per_sec: float, shared: int = 1) -> RunResult:
    return RunResult(
        variant=variant, seed=seed, definition=variant, steps=10, tokens_per_step=8, params=100, routing_params=0,
        val_loss=1.0, val_step=10, val_curve=[(10, 1.0)], train_curve=[(10, 1.0)], tokens_per_sec=tokens_per_sec,
        peak_memory_gib=2.0, shared=shared,
    )  # fmt: skip


def test_speed_ratios_compare_only_runs_that_trained_alone() -> None:
    alone = summarize([run("sum", 0, 400.0), run("mhar", 0, 300.0), run("sum", 1, 200.0), run("mhar", 1, 150.0)], "sum")
    assert [s.speed_ratio for s in alone] == [1.0, pytest.approx(225.0 / 300.0)]  # ratio of the means
    shared = summarize([run("sum", 0, 400.0), run("mhar", 0, 100.0, shared=3)], "sum")
    assert [s.speed_ratio for s in shared] == [1.0, None]
    assert [s.memory_ratio for s in shared] == [1.0, 1.0]  # peak memory stays each run's own
    assert summarize([run("sum", 0, 400.0, shared=2), run("mhar", 0, 100.0)], "sum")[1].speed_ratio is None
    mixed = [run("sum", 0, 90.0, shared=4), run("sum", 1, 400.0), run("mhar", 0, 50.0, shared=4), run("mhar", 1, 200.0)]
    assert [(s.tokens_per_sec, s.speed_ratio) for s in summarize(mixed, "sum")] == [(400.0, 1.0), (200.0, 0.5)]


def test_a_run_whose_validation_is_far_above_its_training_loss_is_named() -> None:
    healthy = run("sum", 0, 400.0)
    broken = replace(run("hyper-connections", 1, 300.0), val_loss=1.5, train_curve=[(9, 0.6), (10, 0.55)])
    assert suspect_runs([healthy]) == []
    (line,) = suspect_runs([healthy, broken])
    assert line.startswith("hyper-connections seed 1: validation loss 1.5000 is 2.6x its training loss 0.5750")
    assert "Runs to check:" in markdown([healthy, broken], summarize([healthy, broken], "sum"), "sum", [])
    assert "Runs to check:" not in markdown([healthy], summarize([healthy], "sum"), "sum", [])


def test_the_environments_runs_trained_in_are_listed_with_their_runs() -> None:
    card = {"device": "NVIDIA H200", "world_size": 1, "torch": "2.11.0", "started": "2026-12-02T10:00:00+00:00"}
    runs = [
        replace(run("sum", 0, 400.0), environment=card),
        replace(run("mhar", 0, 300.0), environment={**card, "started": "2026-12-03T09:00:00+00:00"}),
        replace(run("sum", 1, 400.0), environment={**card, "torch": "2.12.0"}),
    ]
    text = markdown(runs, summarize(runs, "sum"), "sum", [])
    section = text.split("## Environment")[1].splitlines()
    assert "| NVIDIA H200 | 1 | - | 2.11.0 | - | - | - | - | 2026-12-02 - 2026-12-03 | sum 0, mhar 0 |" in section
    assert "| NVIDIA H200 | 1 | - | 2.12.0 | - | - | - | - | 2026-12-02 - 2026-12-02 | sum 1 |" in section
    unrecorded = [run("sum", 0, 400.0)]  # results written before runs recorded their environment
    assert "## Environment" not in markdown(unrecorded, summarize(unrecorded, "sum"), "sum", [])


@pytest.mark.parametrize("width", [80, 100, 200])
def test_the_console_table_fits_the_terminal_and_cuts_no_number(width: int) -> None:
    runs = [run("sum", 0, 123456.0), run("mhar-block-h8", 0, 98765.0)]
    runs = [replace(r, params=123_456_789, routing_params=12_345, steps=20_000, tokens_per_step=524_288) for r in runs]
    summaries = summarize(runs, "sum")
    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None)
    tables = console_tables(summaries, "sum", "2 runs", console.width)
    for table in tables:
        console.print(table)
    lines = out.getvalue().splitlines()
    assert max(len(line) for line in lines) <= width and "…" not in out.getvalue()
    header, rows = summary_rows(summaries, "sum")
    for text in [*header, *(cell for row in rows for cell in row)]:
        assert text in out.getvalue()
    assert (len(tables) == 1) == (width == 200)
    assert all(table.columns[0].header == "variant" for table in tables)
