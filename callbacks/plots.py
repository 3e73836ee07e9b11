"""Matplotlib (Agg, no pyplot state) renderings of depth-attention maps and per-site bar charts.

Heatmaps put routing sites top to bottom (sublayer 0 first, `final` last) and sources left to right (oldest
first), share one fixed colour scale for softmax weights (0..1, square-root stretched so small weights stay visible)
and a diverging one centred at 0 for learned weights of any sign, and leave the cells of sources a site cannot see
blank (hatched grey).
"""

import math
import textwrap

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import Normalize, PowerNorm
from matplotlib.figure import Figure

from mhar_lightning.probe import DepthMaps

CMAP = "viridis"
NORM = PowerNorm(gamma=0.5, vmin=0.0, vmax=1.0)
SIGNED_CMAP = "RdBu_r"  # white at 0, red for positive and blue for negative weights
SITE_AXIS = "routing site (input of sublayer)"
SOURCE_AXIS = "source (output it reads from)"
ROW_SUMS = "each row sums to 1"
BLANK = "blank: source not available at that site"
SOURCE_NOTES = {
    "partial": "block b: sum of block b's sublayer outputs · partial: this block's outputs so far",
    "null": "null: learned null source · Δ block b: residual-stream change over block b",
    "stream 0": "stream k: the k-th of the parallel residual streams (hyper-connections); its read weights are "
    "learned, of any sign, and a row need not sum to 1",
}


def caption(maps: DepthMaps, width_in: float) -> str:
    """How to read a map (row sums, blank cells, block/delta sources), wrapped to `width_in` inches."""
    notes = [note for label, note in SOURCE_NOTES.items() if label in maps.source_labels]
    first = f"{ROW_SUMS} · {BLANK}" if maps.distributions else BLANK
    return "\n".join(textwrap.fill(line, int(width_in * 11)) for line in (first, *notes))


def colour_scale(maps: DepthMaps) -> tuple[str, Normalize]:
    """(colour map, norm) of every panel of `maps`: softmax weights on the fixed 0..1 scale; learned weights (any
    sign) on a diverging map centred at 0, symmetric to the largest |weight| and at least -1..1, so a negative weight
    never takes the colour of zero."""
    finite = maps.weights[np.isfinite(maps.weights)]
    if maps.distributions and not (finite < 0).any():
        return CMAP, NORM
    limit = max(1.0, float(np.abs(finite).max(initial=0.0)))
    return SIGNED_CMAP, Normalize(vmin=-limit, vmax=limit)


def text_colour(cmap: str, norm: Normalize, value: float) -> str:
    """Black on a light cell, white on a dark one."""
    r, g, b, _ = matplotlib.colormaps[cmap](norm(value))
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"


def to_image(fig: Figure) -> np.ndarray:
    """The rendered figure as an RGB uint8 array [height, width, 3] (TensorBoard's `HWC`)."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def _map_size(maps: DepthMaps) -> tuple[float, float]:
    """Figure inches: roomy cells (with printed weights) for small maps, compact ones for deep models."""
    n_sources, n_sites = len(maps.source_labels), len(maps.sites)
    cell_w, cell_h = (0.5, 0.36) if n_sources <= 16 else (0.24, 0.2)
    return max(5.5, 2.6 + cell_w * n_sources), 2.0 + cell_h * n_sites


def draw_map(fig: Figure, ax, weights: np.ndarray, maps: DepthMaps, title: str, colorbar: bool = True) -> None:
    """Draw one [sites, sources] weight map on `ax`, with labelled axes and optional colour bar."""
    masked = np.ma.masked_invalid(weights)
    ax.set_facecolor("#e6e6e6")
    ax.patch.set_hatch("//")
    ax.patch.set_edgecolor("#c8c8c8")
    cmap, norm = colour_scale(maps)
    image = ax.imshow(masked, cmap=cmap, norm=norm, aspect="auto", interpolation="nearest", origin="upper")
    fontsize = 10 if len(maps.source_labels) <= 16 else 7
    ax.set_xticks(
        range(len(maps.source_labels)),
        maps.source_labels,
        rotation=45,
        ha="right",
        rotation_mode="anchor",
        fontsize=fontsize,
    )
    ax.set_yticks(range(len(maps.site_labels)), maps.site_labels, fontsize=fontsize)
    ax.set_xlabel(SOURCE_AXIS)
    ax.set_ylabel(SITE_AXIS)
    ax.set_title(title, fontsize=9)
    if weights.shape[1] <= 16 and weights.shape[0] <= 33:
        for (row, col), value in np.ndenumerate(weights):
            if not np.isnan(value):
                colour = text_colour(cmap, norm, value)
                ax.text(col, row, f"{value:.2f}", ha="center", va="center", fontsize=7, color=colour)
    if colorbar:
        fig.colorbar(image, ax=ax, label="depth-attention weight", fraction=0.06, pad=0.03)


def depth_map_figure(maps: DepthMaps, head: int | None = None, suffix: str = "") -> Figure:
    """One map: a single head's weights, or the head average when `head` is None."""
    weights = maps.mean_weights if head is None else maps.weights[:, head]
    if head is None:
        which = "one head" if maps.heads == 1 else f"mean over {maps.heads} heads"
    else:
        which = f"head {head} of {maps.heads}"
    width, height = _map_size(maps)
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    fig.suptitle(textwrap.fill(f"Depth attention, {which}{suffix}", int(width * 9)), fontsize=11)
    draw_map(fig, fig.add_subplot(), weights, maps, caption(maps, width))
    return fig


def depth_grid_figure(maps: DepthMaps, suffix: str = "") -> Figure:
    """The head average followed by every head (one panel each) with one shared colour bar."""
    panels = [(maps.mean_weights, f"mean over {maps.heads} heads")]
    if maps.heads > 1:
        panels += [(maps.weights[:, h], f"head {h}") for h in range(maps.heads)]
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    width, height = _map_size(maps)
    fig = Figure(figsize=(cols * width, rows * height + 0.4), dpi=100, layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, (weights, name) in zip(axes.flat, panels):
        draw_map(fig, ax, weights, maps, name, colorbar=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_axis_off()
    fig.colorbar(axes.flat[0].images[0], ax=axes, label="depth-attention weight", fraction=0.03, pad=0.02)
    fig.suptitle(f"Depth attention{suffix}\n{caption(maps, cols * width)}", fontsize=11)
    return fig


def site_bar_figure(
    values: dict[str, np.ndarray], site_labels: tuple[str, ...], ylabel: str, title: str, ymax: float | None = None
) -> Figure:
    """Grouped bars per routing site: one bar series per entry of `values` (label -> [sites])."""
    fig = Figure(figsize=(2.5 + 0.45 * len(site_labels), 3.6), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    x = np.arange(len(site_labels))
    width = 0.8 / len(values)
    for i, (label, series) in enumerate(values.items()):
        bars = ax.bar(x + (i - (len(values) - 1) / 2) * width, series, width, label=label)
        ax.bar_label(bars, fmt="%.3f", fontsize=6, rotation=90, padding=2)
    ax.set_xticks(x, site_labels, rotation=45, ha="right", rotation_mode="anchor")
    ax.set_xlabel(SITE_AXIS)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    if ymax is not None:
        ax.set_ylim(0.0, ymax)
    return fig


def disagreement_figure(maps: DepthMaps, suffix: str = "") -> Figure:
    """Bars per site of the mean pairwise head JS divergence, from the captured weights and from the queries.

    The axis ends at 1.3x the largest value (at least 0.05, at most the 1-bit maximum) so early, small
    disagreement stays visible; the printed values make steps comparable.
    """
    values = {"captured weights": maps.head_js()}
    if maps.query_weights is not None:
        values["from trained queries"] = maps.query_head_js()
    note = " (H = 1: heads cannot disagree, 0 by definition)" if maps.heads == 1 else f" between {maps.heads} heads"
    ymax = min(1.0, max(0.05, 1.3 * max(v.max() for v in values.values())))
    return site_bar_figure(
        values, maps.site_labels, "mean pairwise JS divergence (bits)", f"Head disagreement{note}{suffix}", ymax
    )
