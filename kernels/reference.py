"""Pure-PyTorch depth routing: the ground truth that the fused kernels must reproduce.

Each function takes its queries as a `RouteQuery`, or as `query, norm_weight, heads[, eps]` to make one.
"""

import functools
from collections.abc import Sequence

import torch
from mhar_lightning.kernels.query import RouteQuery, check_counts
from torch import Tensor

from mhar_lightning.norm import rms_norm


def depth_logits(
    sources: Sequence[Tensor],
    query: Tensor | RouteQuery,
    norm_weight: Tensor | None = None,
    heads: int | None = None,
    eps: float | None = None,
) -> Tensor:
    """Per-head routing logits of one query, shaped [..., heads, len(sources)], in fp32 (fp64 for fp64 sources).

    The RMS is taken over the full width in fp32 without an fp32 copy of the source, so autograd
    keeps only a reference to each source.
    """
    route = RouteQuery.of(query, norm_weight, heads, eps)
    if len(sources) == 0:
        raise ValueError("depth routing needs at least one source")
    d = route.d
    for v in sources:
        if v.shape[-1] != d:
            raise ValueError(f"source width {v.shape[-1]} does not match query width {d}")
    stat_dtype = functools.reduce(torch.promote_types, (v.dtype for v in sources), torch.float32)
    u = route.split_heads(route.folded(stat_dtype))
    logits = []
    for v in sources:
        rms = torch.linalg.vector_norm(v, dim=-1, keepdim=True, dtype=stat_dtype) * d**-0.5
        logits.append((route.split_heads(v) * u).sum(-1) * torch.rsqrt(rms.square() + route.eps))
    return torch.stack(logits, dim=-1)


def depth_weights(
    sources: Sequence[Tensor],
    query: Tensor | RouteQuery,
    norm_weight: Tensor | None = None,
    heads: int | None = None,
    eps: float | None = None,
) -> Tensor:
    """The softmax over depth, per head: [..., heads, len(sources)]."""
    return torch.softmax(depth_logits(sources, query, norm_weight, heads, eps), dim=-1)


def _mix(weights: Tensor, sources: Sequence[Tensor], route: RouteQuery) -> Tensor:
    """sum_n weights[..., h, n] * v_n[h], in the promoted dtype of the sources."""
    out = sum(weights[..., n, None] * route.split_heads(v) for n, v in enumerate(sources))
    return out.flatten(-2).to(functools.reduce(torch.promote_types, (v.dtype for v in sources)))


def depth_route(
    sources: Sequence[Tensor],
    query: Tensor | RouteQuery,
    norm_weight: Tensor | None = None,
    heads: int | None = None,
    eps: float | None = None,
) -> Tensor:
    """Mix `sources` ([..., d] each) with a per-head softmax over depth (the package docstring's `out`).

    The sources are never stacked, so saved activation memory stays linear in depth. The output has the promoted
    dtype of the sources. [Q, d] queries route Q queries over the same sources: output [Q, ..., d].
    """
    route = RouteQuery.of(query, norm_weight, heads, eps)
    out = depth_route_lse(sources, route)[0]
    return torch.stack(out) if route.query.dim() == 2 else out


def depth_route_lse(
    sources: Sequence[Tensor],
    query: Tensor | RouteQuery,
    norm_weight: Tensor | None = None,
    heads: int | None = None,
    eps: float | None = None,
    counts: Sequence[int] | None = None,
) -> tuple[Tensor, Tensor] | tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """`depth_route` and the per-head log-sum-exp of its logits ([..., heads]).

    [Q, d] queries give Q mixes and Q log-sum-exps, as two tuples; query k reads the first counts[k] sources
    (default: all; a [d] query is one query).
    """
    route = RouteQuery.of(query, norm_weight, heads, eps)
    if route.query.dim() == 2:
        counts = check_counts(counts, route.count, len(sources))
        pairs = [depth_route_lse(sources[:c], route[k]) for k, c in enumerate(counts)]
        return tuple(out for out, _ in pairs), tuple(lse for _, lse in pairs)
    sources = sources[: check_counts(counts, 1, len(sources))[0]]
    logits = depth_logits(sources, route)
    return _mix(torch.softmax(logits, dim=-1), sources, route), torch.logsumexp(logits, dim=-1)


def merge_source(
    mix: Tensor,
    lse: Tensor,
    source: Tensor,
    query: Tensor | RouteQuery,
    norm_weight: Tensor | None = None,
    heads: int | None = None,
    eps: float | None = None,
) -> Tensor:
    """The route over [*sources, source] from the route over `sources` (its `mix` and `lse`), exactly.

    Adding one logit z to a softmax is a two-way softmax between the old mix and the new source:
    out = mix + sigmoid(z - lse) * (source - mix), per head. Sublayers that share most of their sources
    route over the shared part once and merge their own last source here.
    """
    route = RouteQuery.of(query, norm_weight, heads, eps)
    z = depth_logits([source], route)[..., 0]
    weight = torch.sigmoid(z - lse)[..., None]
    old = route.split_heads(mix)
    out = old + weight * (route.split_heads(source) - old)
    return out.flatten(-2).to(torch.promote_types(mix.dtype, source.dtype))


def merge_norm(
    mix: Tensor, lse: Tensor, source: Tensor, route: RouteQuery, weight: Tensor, norm_eps: float, out_dtype: torch.dtype
) -> Tensor:
    """`rms_norm(merge_source(...), weight, norm_eps)` in `out_dtype`: a merged read and the pre-norm of the
    sublayer that reads it."""
    return rms_norm(merge_source(mix, lse, source, route), weight, norm_eps).to(out_dtype)
