"""What a gap costs: the baseline's loss at the variant's GPU time, and the baseline compute that reaches the
variant's loss, both read off the baseline's own validation curve.

Both use the baseline run's validation losses against tokens, interpolated linearly in log tokens. A point of one
cosine schedule is not the final loss of a shorter run (its learning rate has not decayed yet), so reading a
curve before its end overstates what the baseline would reach with that budget: the equal-time gap and the
multiplier below are lower bounds of the variant's advantage where they are read inside the curve. Past the
curve's end the baseline's losses are extrapolated with a power law in tokens, ``L(t) = E + A * t**-alpha``, fitted
to the curve's second half.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mhar_lightning.study.results import RunResult

ALPHAS = np.linspace(0.05, 1.5, 146)
"""Exponents tried by the power-law fit (E and A are then a linear least-squares solve)."""


@dataclass(frozen=True)
class PowerLaw:
    """``loss(t) = floor + scale * t ** -alpha``."""

    floor: float
    scale: float
    alpha: float

    def loss(self, tokens: float) -> float:
        return self.floor + self.scale * tokens**-self.alpha

    def tokens(self, loss: float) -> float | None:
        """Tokens at which the law reaches ``loss`` (None at or below its floor)."""
        if loss <= self.floor or self.scale <= 0:
            return None
        return ((loss - self.floor) / self.scale) ** (-1 / self.alpha)


def fit_power_law(tokens: Sequence[float], losses: Sequence[float]) -> PowerLaw:
    """The least-squares ``E + A * t**-alpha`` through the points, alpha on a grid (at least three points)."""
    if len(tokens) < 3:
        raise ValueError(f"a power law needs at least 3 points, got {len(tokens)}")
    t, y = np.asarray(tokens, dtype=float), np.asarray(losses, dtype=float)
    best: tuple[float, PowerLaw] | None = None
    for alpha in ALPHAS:
        design = np.stack([np.ones_like(t), t**-alpha], axis=1)
        (floor, scale), *_ = np.linalg.lstsq(design, y, rcond=None)
        residual = float(np.sum((design @ np.array([floor, scale]) - y) ** 2))
        if best is None or residual < best[0]:
            best = (residual, PowerLaw(float(floor), float(scale), float(alpha)))
    return best[1]


def curve(run: RunResult) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, validation loss) of ``run``, in increasing tokens."""
    points = sorted(run.val_curve)
    return np.array([s * run.tokens_per_step for s, _ in points], dtype=float), np.array([v for _, v in points])


def tail_law(run: RunResult) -> PowerLaw | None:
    """The power law fitted to the second half (by tokens) of ``run``'s validation curve, or to all of it when the
    half has fewer than 3 points (None with fewer than 3 in all)."""
    tokens, losses = curve(run)
    late = tokens >= tokens[-1] / 2
    if late.sum() < 3:
        late = np.ones_like(late)
    return fit_power_law(tokens[late], losses[late]) if late.sum() >= 3 else None


def loss_at(run: RunResult, tokens: float) -> float | None:
    """``run``'s validation loss after ``tokens``: interpolated in log tokens inside its curve, from `tail_law` past
    its end; None before its first point or where no law can be fitted."""
    t, losses = curve(run)
    if tokens < t[0]:
        return None
    if tokens <= t[-1]:
        return float(np.interp(math.log(tokens), np.log(t), losses))
    law = tail_law(run)
    return None if law is None else law.loss(tokens)


def tokens_to_reach(run: RunResult, loss: float) -> float | None:
    """Tokens after which ``run``'s validation loss first reaches ``loss``: interpolated in log tokens inside its
    curve, from `tail_law` past its end; None if its first point is already below, or the law never gets there."""
    t, losses = curve(run)
    if loss > losses[0]:
        return None
    for i in range(1, len(t)):
        if losses[i] <= loss:
            low, high = losses[i - 1], losses[i]
            share = (low - loss) / (low - high) if low != high else 1.0
            return math.exp(math.log(t[i - 1]) + share * (math.log(t[i]) - math.log(t[i - 1])))
    law = tail_law(run)
    return None if law is None else law.tokens(loss)


@dataclass(frozen=True)
class Cost:
    """One run against the baseline run of its seed."""

    gap: float
    """final validation loss minus the baseline's (same tokens)"""
    equal_time_gap: float | None
    """final loss minus the baseline's after the same GPU time (the run's tokens / ``speed_ratio``)"""
    compute_multiplier: float | None
    """baseline tokens that reach the run's final loss, over the run's tokens (above 1: the run is worth more)"""


def cost(run: RunResult, base: RunResult, speed_ratio: float | None) -> Cost:
    """`Cost` of ``run`` against ``base`` (same seed); ``speed_ratio``: the run's tokens/s over the baseline's,
    measured alone on one card (None: no equal-time gap)."""
    reference = None if speed_ratio is None else loss_at(base, run.tokens / speed_ratio)
    reach = tokens_to_reach(base, run.val_loss)
    return Cost(
        gap=run.val_loss - base.val_loss,
        equal_time_gap=None if reference is None else run.val_loss - reference,
        compute_multiplier=None if reach is None else reach / run.tokens,
    )
