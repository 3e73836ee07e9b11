"""Depth-attention probing shared by the callbacks and `mhar inspect`: run a probe batch, label, summarise.

`run_probe` runs a model on a token batch under `capture_depth_attention` and returns `DepthMaps`: for every
routing site (the input of each sublayer, plus the final read where the strategy has one) the softmax
weights per head over that site's sources, averaged over the probe's tokens, laid out on one shared source
axis so that a site x source heatmap is meaningful (cells of sources a site cannot see are NaN):

- full routing (`mhar`/`attnres` without blocks): `emb, attn 0, mlp 0, attn 1, ...` (a triangle);
- block routing: `emb, block 1 .. block N, partial` where `block b` is the finished sum of block b's sublayer
  outputs and `partial` is the running sum of the reading sublayer's own block (absent at a block's start);
- `delta-mhar`: `null, emb, Δ block 1, ...` (block deltas of the untouched residual stream; no final read).
"""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from mhar_lightning.parallel import full_tensor
from mhar_lightning.residual.delta import DeltaMHAR
from mhar_lightning.residual.routed import MHAR, DepthRouter, capture_depth_attention

Reduce = Callable[[Tensor], Tensor]
"""Averages a tensor over data-parallel ranks (identity on one process)."""


def sublayer_label(l: int, n_sublayers: int) -> str:
    """`attn i` / `mlp i` for sublayer `l` of transformer block i; `final` for the final read (l = L)."""
    if l == n_sublayers:
        return "final"
    return f"{'attn' if l % 2 == 0 else 'mlp'} {l // 2}"


def tag_name(label: str) -> str:
    """A label made safe for a TensorBoard tag (`mlp 3` -> `mlp_3`)."""
    return label.replace(" ", "_")


@dataclass(frozen=True)
class DepthLayout:
    """Where each site's sources sit on the shared source axis."""

    sites: tuple[int, ...]
    site_labels: tuple[str, ...]
    source_labels: tuple[str, ...]
    columns: tuple[tuple[int, ...], ...]
    """`columns[s][n]`: the column of source n of site s (sources in the order the router sees them)."""


def routers_of(model: nn.Module) -> list[DepthRouter]:
    """The spawned depth routers of `model` in module order, strategy templates left out (empty for `sum`)."""
    return [m for m in model.modules() if isinstance(m, DepthRouter) and hasattr(m, "sites")]


def depth_layout(routers: Sequence[DepthRouter], sources_per_site: dict[int, int]) -> DepthLayout:
    """The shared source axis for `routers`, checked against the source counts seen in a capture.

    Strategies other than MHAR/AttnRes/delta-MHAR get generic `source n` columns.
    """
    if not routers:
        raise ValueError("the model has no depth routers (residual 'sum'): there are no depth-attention weights")
    router, n_sublayers = routers[0], routers[0].n_sublayers
    sites = tuple(sorted(sources_per_site))
    if isinstance(router, DeltaMHAR):
        n_deltas = max(sources_per_site.values()) - 2
        labels = ["null", "emb", *(f"Δ block {b}" for b in range(1, n_deltas + 1))]
        columns = [tuple(range(2 + l // router.block_len)) for l in sites]
    elif isinstance(router, MHAR) and router.block_len == 1:
        labels = ["emb", *(sublayer_label(i, n_sublayers) for i in range(n_sublayers))]
        columns = [tuple(range(l + 1)) for l in sites]
    elif isinstance(router, MHAR):
        n_blocks = math.ceil(n_sublayers / router.block_len)
        labels = ["emb", *(f"block {b}" for b in range(1, n_blocks + 1)), "partial"]
        columns = [
            tuple(range(l // router.block_len + 1)) + ((len(labels) - 1,) if l % router.block_len else ())
            for l in sites
        ]
    else:
        labels = [f"source {n}" for n in range(max(sources_per_site.values()))]
        columns = [tuple(range(sources_per_site[l])) for l in sites]
    for l, cols in zip(sites, columns):
        if len(cols) != sources_per_site[l]:
            raise ValueError(
                f"site {l}: layout expects {len(cols)} sources, the router routed over {sources_per_site[l]}"
            )
    used = sorted({c for cols in columns for c in cols})
    renumber = {c: i for i, c in enumerate(used)}
    return DepthLayout(
        sites=sites,
        site_labels=tuple(sublayer_label(l, n_sublayers) for l in sites),
        source_labels=tuple(labels[c] for c in used),
        columns=tuple(tuple(renumber[c] for c in cols) for cols in columns),
    )


def entropy(p: np.ndarray) -> np.ndarray:
    """Shannon entropy in nats over the last axis; NaN entries (absent sources) count as zero mass."""
    p = np.nan_to_num(p)
    return -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=-1)


def js_divergence(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Jensen-Shannon divergence in bits (0 = identical, 1 = disjoint support) over the last axis."""
    m = 0.5 * (np.nan_to_num(p) + np.nan_to_num(q))
    return np.maximum(entropy(m) - 0.5 * (entropy(p) + entropy(q)), 0.0) / np.log(2)


def mean_pairwise_js(p: np.ndarray) -> np.ndarray:
    """Mean JS divergence (bits) over all pairs of heads: `p` is [..., heads, sources]; 0 for one head."""
    heads = p.shape[-2]
    if heads < 2:
        return np.zeros(p.shape[:-2])
    pairs = [js_divergence(p[..., i, :], p[..., j, :]) for i in range(heads) for j in range(i + 1, heads)]
    return np.mean(pairs, axis=0)


@dataclass(frozen=True)
class DepthMaps:
    """Depth-attention weights of one probe: `weights[site, head, source]`, NaN where a site lacks a source.

    `query_weights` holds the same per-head distributions computed directly from the trained queries against
    the probe's token-mean normalised keys (see `run_probe`); `gates` the delta-MHAR gate of every sublayer.
    """

    sites: tuple[int, ...]
    site_labels: tuple[str, ...]
    source_labels: tuple[str, ...]
    weights: np.ndarray
    query_weights: np.ndarray
    gates: np.ndarray | None = None

    @property
    def heads(self) -> int:
        return self.weights.shape[1]

    @property
    def mean_weights(self) -> np.ndarray:
        """[sites, sources]: the head average (each head mixes its own d/H slice, so this is the mean routing)."""
        return self.weights.mean(axis=1)

    def entropy(self) -> np.ndarray:
        """[sites]: entropy (nats) of each head's token-averaged depth distribution, averaged over heads."""
        return entropy(self.weights).mean(axis=1)

    def embedding_weight(self) -> np.ndarray:
        """[sites]: head-averaged weight on the token embedding."""
        return self.mean_weights[:, self.source_labels.index("emb")]

    def recent_weight(self) -> np.ndarray:
        """[sites]: head-averaged weight on each site's most recent source (the last one it can see)."""
        mean = self.mean_weights
        last = np.array([np.flatnonzero(~np.isnan(row))[-1] for row in mean])
        return mean[np.arange(len(mean)), last]

    def head_js(self) -> np.ndarray:
        """[sites]: mean pairwise JS divergence (bits) between the heads' captured depth distributions."""
        return mean_pairwise_js(self.weights)

    def query_head_js(self) -> np.ndarray:
        """[sites]: the same, between the distributions computed from the trained queries (`query_weights`)."""
        return mean_pairwise_js(self.query_weights)

    def save(self, path: str | Path) -> Path:
        """Write an `.npz` with the weights and their site/source labels (load it back with `DepthMaps.load`)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays = {
            "sites": np.array(self.sites),
            "site_labels": np.array(self.site_labels),
            "source_labels": np.array(self.source_labels),
            "weights": self.weights,
            "query_weights": self.query_weights,
        }
        if self.gates is not None:
            arrays["gates"] = self.gates
        np.savez(path, **arrays)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "DepthMaps":
        with np.load(path) as data:
            return cls(
                sites=tuple(int(s) for s in data["sites"]),
                site_labels=tuple(str(s) for s in data["site_labels"]),
                source_labels=tuple(str(s) for s in data["source_labels"]),
                weights=data["weights"],
                query_weights=data["query_weights"],
                gates=data.get("gates"),
            )


def query_weights(router: DepthRouter, l: int, mean_keys: Tensor) -> Tensor:
    """[heads, sources]: softmax over depth of each head's query chunk (key gain folded in) against `mean_keys`."""
    j = router.site(l)
    u = (full_tensor(router.query)[j].float() * full_tensor(router.key_norm)[j].float()).cpu()
    chunks = u.view(router.heads, -1)
    keys = mean_keys.view(mean_keys.shape[0], router.heads, -1)
    return torch.softmax(torch.einsum("nhc,hc->hn", keys, chunks), dim=-1)


def _layout_array(per_site: Sequence[Tensor], layout: DepthLayout) -> np.ndarray:
    """Scatter per-site [heads, n_sources] tensors onto the shared axis: [sites, heads, columns], NaN elsewhere."""
    heads = per_site[0].shape[0]
    out = np.full((len(layout.sites), heads, len(layout.source_labels)), np.nan)
    for s, (w, cols) in enumerate(zip(per_site, layout.columns)):
        out[s][:, list(cols)] = w.detach().double().numpy()
    return out


def _reduce_together(tensors: Sequence[Tensor], reduce: Reduce) -> list[Tensor]:
    """`reduce` applied once to all `tensors` packed flat (one collective instead of one per tensor)."""
    flat = reduce(torch.cat([t.float().flatten() for t in tensors]))
    return [chunk.view_as(t) for chunk, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


def run_probe(model: nn.Module, tokens: Tensor, reduce: Reduce | None = None) -> DepthMaps:
    """Run `model(tokens)` once (eval mode, no grad) and return its depth-attention maps.

    `tokens` is [B, T] model input. `reduce` averages the captured statistics over data-parallel ranks (one
    call on one flat tensor) before anything is derived from them, so every rank ends with the same maps; the
    model runs on every rank (as FSDP needs). `query_weights` take each head's softmax of its trained query
    chunk against the token-mean RMS-normalised key of every source: the routing the queries alone imply for a
    typical token, which separates the queries' own disagreement from token-to-token variation.
    """
    routers = routers_of(model)
    if not routers:
        raise ValueError("the model has no depth routers (residual 'sum'): there are no depth-attention weights")
    reduce = reduce or (lambda t: t)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), capture_depth_attention(model) as captured:
            model(tokens)
    finally:
        model.train(was_training)
    by_site = {l: r for r in routers for l in r.sites if l in captured.weights}
    layout = depth_layout(routers, {l: w.shape[-1] for l, w in captured.weights.items()})
    n = len(layout.sites)
    stats = [captured.weights[l] for l in layout.sites] + [captured.keys[l] for l in layout.sites]
    reduced = _reduce_together(stats, reduce)
    weights, mean_keys = reduced[:n], reduced[n:]
    from_queries = [query_weights(by_site[l], l, k) for l, k in zip(layout.sites, mean_keys)]
    gates = [
        full_tensor(r.gate).detach().float().cpu() for r in routers if isinstance(r, DeltaMHAR) and hasattr(r, "gate")
    ]
    return DepthMaps(
        sites=layout.sites,
        site_labels=layout.site_labels,
        source_labels=layout.source_labels,
        weights=_layout_array(weights, layout),
        query_weights=_layout_array(from_queries, layout),
        gates=torch.cat(gates).numpy() if gates else None,
    )
