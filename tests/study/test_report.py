"""The study report's speeds and speed ratios: only of runs that had their machine to themselves."""

import pytest

from mhar_lightning.study.report import summarize
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
