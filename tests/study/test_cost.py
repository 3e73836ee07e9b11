"""What a gap costs, read off the baseline's curve: checked on curves drawn from a known power law, where the
answers are closed-form."""

import math
from dataclasses import replace

import pytest

from mhar_lightning.study.cost import PowerLaw, cost, fit_power_law, loss_at, tokens_to_reach
from mhar_lightning.study.report import markdown, summarize
from mhar_lightning.study.results import RunResult

LAW = PowerLaw(floor=2.0, scale=40.0, alpha=0.3)
STEPS = [100 * k for k in range(1, 9)]
TOKENS_PER_STEP = 1000


def run(variant: str, law: PowerLaw, steps: list[int] = STEPS) -> RunResult:
    curve = [(s, law.loss(s * TOKENS_PER_STEP)) for s in steps]
    return RunResult(
        variant=variant, seed=0, definition=variant, steps=steps[-1], tokens_per_step=TOKENS_PER_STEP, params=1,
        routing_params=0, val_loss=curve[-1][1], val_step=steps[-1], val_curve=curve, train_curve=curve,
        tokens_per_sec=None, peak_memory_gib=None,
    )  # fmt: skip


def test_the_fit_recovers_a_power_law_from_its_points() -> None:
    tokens = [1e5 * k for k in range(1, 12)]
    fitted = fit_power_law(tokens, [LAW.loss(t) for t in tokens])
    assert fitted.alpha == pytest.approx(LAW.alpha, abs=1e-9)
    assert (fitted.floor, fitted.scale) == (pytest.approx(LAW.floor, rel=1e-6), pytest.approx(LAW.scale, rel=1e-6))
    with pytest.raises(ValueError, match="at least 3 points"):
        fit_power_law([1.0, 2.0], [3.0, 2.0])


def test_losses_and_tokens_are_read_inside_the_curve_and_extrapolated_past_it() -> None:
    base = run("sum", LAW)
    assert loss_at(base, 400_000) == LAW.loss(400_000)  # a validation point
    between = loss_at(base, 450_000)
    assert LAW.loss(500_000) < between < LAW.loss(400_000)
    assert loss_at(base, 3_000_000) == pytest.approx(LAW.loss(3_000_000), rel=1e-6)  # past the end: the fit
    assert loss_at(base, 50_000) is None  # before the first validation
    assert loss_at(run("short", LAW, [100, 200]), 300_000) is None  # too few points to extrapolate
    assert tokens_to_reach(base, LAW.loss(600_000)) == pytest.approx(600_000)
    assert tokens_to_reach(base, LAW.loss(2_400_000)) == pytest.approx(2_400_000, rel=1e-5)
    assert tokens_to_reach(base, LAW.loss(50_000)) is None  # above the first point
    assert tokens_to_reach(base, LAW.floor - 0.1) is None  # below the law's floor


def test_a_variant_worth_twice_the_compute_and_half_as_fast() -> None:
    """A variant on the baseline's law with twice its tokens (same steps): its loss is the baseline's at 2x tokens,
    so its multiplier is 2; at half the speed, after equal GPU time, the baseline has seen twice the tokens and is
    level."""
    base = run("sum", LAW)
    better = run("mhar", PowerLaw(LAW.floor, LAW.scale * 2**-LAW.alpha, LAW.alpha))
    result = cost(better, base, speed_ratio=0.5)
    end = base.tokens
    assert result.gap == pytest.approx(LAW.loss(2 * end) - LAW.loss(end))
    assert result.compute_multiplier == pytest.approx(2.0, rel=1e-5)
    assert result.equal_time_gap == pytest.approx(0.0, abs=1e-6)
    assert cost(better, base, speed_ratio=0.8).equal_time_gap < 0  # faster than break-even: still ahead
    assert cost(better, base, speed_ratio=None).equal_time_gap is None
    worse = run("full", PowerLaw(LAW.floor, LAW.scale * 1.2, LAW.alpha))
    slow = cost(worse, base, speed_ratio=1.0)
    assert slow.gap > 0 and slow.compute_multiplier < 1
    assert slow.compute_multiplier == pytest.approx(1.2 ** (-1 / LAW.alpha), rel=5e-3)  # interpolated
    assert math.isclose(slow.equal_time_gap, slow.gap)


def test_the_report_has_a_cost_row_per_variant_paired_by_seed() -> None:
    base = replace(run("sum", LAW), tokens_per_sec=1000.0)
    better = replace(run("mhar", PowerLaw(LAW.floor, LAW.scale * 2**-LAW.alpha, LAW.alpha)), tokens_per_sec=500.0)
    text = markdown([base, better], summarize([base, better], "sum"), "sum", [])
    section = text.split("## Cost")[1].splitlines()
    row = next(line for line in section if line.startswith("| mhar |"))
    assert row.split(" | ")[1:] == [
        "0.50x",
        f"{better.val_loss - base.val_loss:+.4f}",
        "-0.0000",
        "2.00x |",
    ]  # level, to rounding
    assert "## Cost" not in markdown([base], summarize([base], "sum"), "sum", [])
