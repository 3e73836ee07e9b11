"""The study's PNG plots (Agg, no pyplot state): loss against tokens with seed bands, the head sweep, depth maps."""

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from mhar_lightning.callbacks.plots import depth_map_figure
from mhar_lightning.probe import DepthMaps
from mhar_lightning.study.report import VariantSummary
from mhar_lightning.study.results import DEPTH_MAPS, RunResult

DPI = 80
SMOOTH = 9
"""Training-loss curves are averaged over this many consecutive logged values."""


def seed_band(
    runs: list[RunResult], curve: str, smooth: int = 1
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, mean, min, max) over seeds at the steps every seed logged; optionally a moving average first.
    A continued run's validation curve starts at step 0 with its starting weights' loss."""
    per_seed = [dict(getattr(r, curve)) for r in runs]
    if curve == "val_curve" and all(r.initial_val_loss is not None for r in runs):
        per_seed = [{0: r.initial_val_loss, **c} for r, c in zip(runs, per_seed)]
    steps = sorted(set.intersection(*(set(c) for c in per_seed)))
    values = np.array([[c[s] for s in steps] for c in per_seed], dtype=float)
    if smooth > 1 and values.shape[1] >= smooth:
        kernel = np.ones(smooth) / smooth
        values = np.array([np.convolve(row, kernel, mode="valid") for row in values])
        steps = steps[smooth - 1 :]
    tokens = np.array(steps, dtype=float) * runs[0].tokens_per_step
    return tokens, values.mean(0), values.min(0), values.max(0)


def loss_figure(by_variant: dict[str, list[RunResult]]) -> Figure:
    """Validation (left) and smoothed training loss (right) against tokens: seed mean, min-max band."""
    fig = Figure(figsize=(11, 4.2), dpi=DPI, layout="constrained")
    for ax, curve, title, smooth in zip(
        fig.subplots(1, 2), ("val_curve", "train_curve"), ("validation loss", "training loss"), (1, SMOOTH)
    ):
        tails = []
        for name, runs in by_variant.items():
            tokens, mean, low, high = seed_band(runs, curve, smooth)
            if not len(tokens):
                continue
            label = f"{name} ({len(runs)} seed{'s' if len(runs) > 1 else ''})"
            (line,) = ax.plot(tokens, mean, label=label, marker="." if len(tokens) < 30 else "")
            ax.fill_between(tokens, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
            # the last three quarters (and a continued run's start) decide the y-range: early losses would flatten
            # the differences
            late = (tokens >= 0.25 * tokens[-1]) | (tokens == 0)
            tails.append((low[late].min(), high[late].max()))
        if tails:
            bottom, top = min(low for low, _ in tails), max(high for _, high in tails)
            ax.set_ylim(bottom - 0.05 * (top - bottom + 1e-3), top + 0.1 * (top - bottom + 1e-3))
        ax.set_xlabel("tokens")
        ax.set_ylabel(title)
        ax.set_title(f"{title} (band: min-max over seeds)", fontsize=10)
        ax.grid(alpha=0.3)
        if ax.lines:  # a run too short to log a training loss leaves its panel empty
            ax.legend(fontsize=7)
    return fig


def head_groups(summaries: list[VariantSummary], runs: list[RunResult]) -> dict[str, list[tuple[int, str]]]:
    """Routed variants that differ only in their number of heads (AttnRes counts as one head): group label ->
    [(heads, variant)], for groups with two or more head counts. Heads are read from the run's depth maps."""
    groups: dict[str, list[tuple[int, str]]] = {}
    settings = {r.variant: r.hparams for r in runs}
    for summary in summaries:
        hparams = settings.get(summary.variant, {})
        heads, residual = hparams.get("routing_heads"), hparams.get("residual")
        if heads is None or not isinstance(residual, dict):
            continue
        others = {k: v for k, v in residual.get("init_args", {}).items() if k != "heads"}
        label = ", ".join(f"{k}={v}" for k, v in sorted(others.items())) or "routed"
        groups.setdefault(label, []).append((heads, summary.variant))
    return {label: sorted(members) for label, members in groups.items() if len({h for h, _ in members}) > 1}


def heads_figure(groups: dict[str, list[tuple[int, str]]], summaries: list[VariantSummary], baseline: str) -> Figure:
    """Final validation loss against the number of heads (mean, error bar: sd over seeds), baseline dashed."""
    by_name = {s.variant: s for s in summaries}
    fig = Figure(figsize=(5.5, 3.8), dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    for label, members in groups.items():
        heads = [h for h, _ in members]
        means = [by_name[v].val_loss for _, v in members]
        sds = [by_name[v].val_loss_sd or 0.0 for _, v in members]
        ax.errorbar(heads, means, yerr=sds, marker="o", capsize=3, label=label)
    if baseline in by_name:
        ax.axhline(by_name[baseline].val_loss, color="grey", linestyle="--", label=baseline)
    all_heads = sorted({h for members in groups.values() for h, _ in members})
    ax.set_xscale("log", base=2)
    ax.set_xticks(all_heads, [str(h) for h in all_heads])
    ax.set_xlabel("heads H (H = 1: AttnRes)")
    ax.set_ylabel("final validation loss")
    ax.set_title("Head-count sweep (error bars: sd over seeds)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def write_plots(study: Path, runs: list[RunResult], summaries: list[VariantSummary], baseline: str) -> list[Path]:
    """Write `loss.png`, `heads.png` (when variants differ only in heads) and `depth_<variant>.png`; return them."""
    by_variant: dict[str, list[RunResult]] = {}
    for run in runs:
        by_variant.setdefault(run.variant, []).append(run)
    figures = {"loss": loss_figure(by_variant)}
    groups = head_groups(summaries, runs)
    if groups:
        figures["heads"] = heads_figure(groups, summaries, baseline)
    for name, group in by_variant.items():
        run = min(group, key=lambda r: r.seed)
        maps_file = study / "runs" / name / f"seed{run.seed}" / DEPTH_MAPS
        if maps_file.is_file():
            suffix = f" · {name}, seed {run.seed}, step {run.steps}"
            figures[f"depth_{name}"] = depth_map_figure(DepthMaps.load(maps_file), None, suffix)
    paths = []
    for stem, fig in figures.items():
        paths.append(study / f"{stem}.png")
        fig.savefig(paths[-1], dpi=DPI)
    return paths
