"""The study's loss plot data: seed bands at the steps every seed logged, and a continued run's starting loss."""

from dataclasses import replace

import numpy as np

from mhar_lightning.study.plots import seed_band
from mhar_lightning.study.results import RunResult


def run(seed: int, val_curve: list[tuple[int, float]], initial: float | None = None) -> RunResult:
    return RunResult(
        variant="sum", seed=seed, definition="sum", steps=20, tokens_per_step=8, params=100, routing_params=0,
        val_loss=val_curve[-1][1], val_step=val_curve[-1][0], val_curve=val_curve, train_curve=[], tokens_per_sec=None,
        peak_memory_gib=None, initial_val_loss=initial,
    )  # fmt: skip


def test_the_band_spans_the_seeds_at_their_common_steps() -> None:
    runs = [run(0, [(10, 2.0), (20, 1.0)]), run(1, [(10, 4.0), (15, 9.0), (20, 3.0)])]
    tokens, mean, low, high = seed_band(runs, "val_curve")
    np.testing.assert_array_equal(tokens, [80, 160])
    np.testing.assert_array_equal(mean, [3.0, 2.0])
    np.testing.assert_array_equal(low, [2.0, 1.0])
    np.testing.assert_array_equal(high, [4.0, 3.0])


def test_a_continued_runs_validation_curve_starts_at_its_starting_loss() -> None:
    runs = [run(0, [(10, 2.0), (20, 1.0)], initial=5.0), run(1, [(10, 4.0), (20, 3.0)], initial=7.0)]
    tokens, mean, low, high = seed_band(runs, "val_curve")
    np.testing.assert_array_equal(tokens, [0, 80, 160])
    np.testing.assert_array_equal(mean, [6.0, 3.0, 2.0])
    np.testing.assert_array_equal((low[0], high[0]), (5.0, 7.0))
    partly = [runs[0], replace(runs[1], initial_val_loss=None)]  # a start known for one seed only is not drawn
    np.testing.assert_array_equal(seed_band(partly, "val_curve")[0], [80, 160])
