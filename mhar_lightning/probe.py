"""Depth-attention probing shared by the callbacks and `mhar inspect`: run a probe batch, label, summarise.

`run_probe` runs a model on a token batch under `capture_sites` and returns `DepthMaps`: for every routing
site (the input of each sublayer, plus the final read where the strategy has one) the weights per head over
that site's sources, averaged over the probe's tokens, laid out on one shared source axis so that a site x
source heatmap is meaningful (cells of sources a site cannot see are NaN). The strategy names the sources and
says which site reads which (`Residual.source_labels`, `Residual.site_sources`), e.g.:

- full routing (`mhar`/`attnres` without blocks): `emb, attn 0, mlp 0, attn 1, ...` (a triangle);
- block routing: `emb, block 1 .. block N, partial` where `block b` is the finished sum of block b's sublayer
  outputs and `partial` is the running sum of the reading sublayer's own block (absent at a block's start);
- `delta-mhar`: `null, emb, Δ block 1, ...` (block deltas of the untouched residual stream; no final read);
- `hyper-connections`: `stream 0 .. stream n-1` (the read weights of the n parallel streams).
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from mhar_lightning.residual import Residual, capture_sites, sublayer_label

Reduce = Callable[[Tensor], Tensor]
"""Averages a tensor over data-parallel ranks (identity on one process)."""


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


def routers_of(model: nn.Module) -> list[Residual]:
    """The spawned routers of `model` whose strategy describes sources to probe (none for `sum`), in module order."""
    return [m for m in model.modules() if isinstance(m, Residual) and hasattr(m, "sites") and m.source_labels()]


def depth_layout(routers: Sequence[Residual], sources_per_site: dict[int, int]) -> DepthLayout:
    """The shared source axis of `routers`' strategy, checked against the source counts seen in a capture."""
    if not routers:
        raise ValueError("the model's residual has no routing sites to probe (e.g. 'sum')")
    by_site = {l: r for r in routers for l in r.sites}
    labels, n_sublayers = routers[0].source_labels(), routers[0].n_sublayers
    sites = tuple(sorted(sources_per_site))
    columns = [by_site[l].site_sources(l) for l in sites]
    for l, cols in zip(sites, columns):
        if len(cols) != sources_per_site[l]:
            raise ValueError(f"site {l}: layout expects {len(cols)} sources, the router recorded {sources_per_site[l]}")
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

    `query_weights` (query-based strategies only) holds the same per-head distributions computed directly from
    the trained queries against the probe's token-mean normalised keys (see `run_probe`); `scalars` the named
    per-site values a strategy records (e.g. `delta_gate`), each [sites], NaN at sites without it; `distributions`
    whether the weights are probabilities over the sources (`Residual.weights_are_distributions`).
    """

    sites: tuple[int, ...]
    site_labels: tuple[str, ...]
    source_labels: tuple[str, ...]
    weights: np.ndarray
    query_weights: np.ndarray | None = None
    scalars: dict[str, np.ndarray] = field(default_factory=dict)
    distributions: bool = True

    @property
    def heads(self) -> int:
        return self.weights.shape[1]

    @property
    def mean_weights(self) -> np.ndarray:
        """[sites, sources]: the head average (each head mixes its own d/H slice, so this is the mean routing)."""
        return self.weights.mean(axis=1)

    def entropy(self) -> np.ndarray | None:
        """[sites]: entropy (nats) of each head's token-averaged depth distribution, averaged over heads (None for
        weights that are not distributions)."""
        return entropy(self.weights).mean(axis=1) if self.distributions else None

    def embedding_weight(self) -> np.ndarray | None:
        """[sites]: head-averaged weight on the token embedding (None when the embedding is not a source)."""
        if "emb" not in self.source_labels:
            return None
        return self.mean_weights[:, self.source_labels.index("emb")]

    def recent_weight(self) -> np.ndarray | None:
        """[sites]: head-averaged weight on each site's most recent source (the last one it can see); None for
        weights that are not distributions over depth (parallel streams have no most recent one)."""
        if not self.distributions:
            return None
        mean = self.mean_weights
        last = np.array([np.flatnonzero(~np.isnan(row))[-1] for row in mean])
        return mean[np.arange(len(mean)), last]

    def head_js(self) -> np.ndarray:
        """[sites]: mean pairwise JS divergence (bits) between the heads' captured depth distributions."""
        return mean_pairwise_js(self.weights)

    def query_head_js(self) -> np.ndarray | None:
        """[sites]: the same, between the distributions computed from the trained queries (`query_weights`)."""
        return None if self.query_weights is None else mean_pairwise_js(self.query_weights)

    def save(self, path: str | Path) -> Path:
        """Write an `.npz` with the weights and their site/source labels (load it back with `DepthMaps.load`)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays = {
            "sites": np.array(self.sites),
            "site_labels": np.array(self.site_labels),
            "source_labels": np.array(self.source_labels),
            "weights": self.weights,
            "distributions": np.array(self.distributions),
            **({} if self.query_weights is None else {"query_weights": self.query_weights}),
            **{f"scalar/{name}": values for name, values in self.scalars.items()},
        }
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
                query_weights=data.get("query_weights"),
                scalars={k.removeprefix("scalar/"): data[k] for k in data.files if k.startswith("scalar/")},
                distributions=bool(data["distributions"]) if "distributions" in data.files else True,
            )


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
    model runs on every rank (as FSDP needs). For a query-based strategy, `query_weights` take each head's
    softmax of its trained query chunk against the token-mean RMS-normalised key of every source: the routing
    the queries alone imply for a typical token, which separates the queries' own disagreement from
    token-to-token variation.
    """
    routers = routers_of(model)
    if not routers:
        raise ValueError("the model's residual has no routing sites to probe (e.g. 'sum')")
    reduce = reduce or (lambda t: t)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), capture_sites(model) as captured:
            model(tokens)
    finally:
        model.train(was_training)
    by_site = {l: r for r in routers for l in r.sites}
    layout = depth_layout(routers, {l: w.shape[-1] for l, w in captured.weights.items()})
    keyed = [l for l in layout.sites if l in captured.keys]
    scalar_keys = [(l, name) for l in layout.sites for name in sorted(captured.scalars.get(l, {}))]
    stats = [captured.weights[l] for l in layout.sites] + [captured.keys[l] for l in keyed]
    stats += [captured.scalars[l][name] for l, name in scalar_keys]
    reduced = iter(_reduce_together(stats, reduce))
    weights = [next(reduced) for _ in layout.sites]
    mean_keys = {l: next(reduced) for l in keyed}
    scalars: dict[str, np.ndarray] = {}
    for (l, name), value in zip(scalar_keys, reduced):
        scalars.setdefault(name, np.full(len(layout.sites), np.nan))[layout.sites.index(l)] = float(value)
    query_weights = None
    if keyed == list(layout.sites):
        from_queries = [by_site[l].query_weights(captured.queries[l], mean_keys[l]) for l in layout.sites]
        query_weights = _layout_array(from_queries, layout)
    return DepthMaps(
        sites=layout.sites,
        site_labels=layout.site_labels,
        source_labels=layout.source_labels,
        weights=_layout_array(weights, layout),
        query_weights=query_weights,
        scalars=scalars,
        distributions=routers[0].weights_are_distributions,
    )
