"""Pure-PyTorch depth routing: the ground truth that the fused kernels must reproduce."""

import functools
from collections.abc import Sequence

import torch
from mhar_lightning.kernels.query import check_counts, check_heads
from torch import Tensor

from mhar_lightning.norm import rms_norm


def depth_logits(
    sources: Sequence[Tensor], query: Tensor, norm_weight: Tensor, heads: int, eps: float = 1e-6
) -> Tensor:
    """Per-head routing logits, shaped [..., heads, len(sources)], in fp32 (fp64 for fp64 sources).

    The RMS is taken over the full width in fp32 without an fp32 copy of the source, so autograd
    keeps only a reference to each source.
    """
    if len(sources) == 0:
        raise ValueError("depth routing needs at least one source")
    d = query.shape[-1]
    check_heads(d, heads)
    for v in sources:
        if v.shape[-1] != d:
            raise ValueError(f"source width {v.shape[-1]} does not match query width {d}")
    stat_dtype = functools.reduce(torch.promote_types, (v.dtype for v in sources), torch.float32)
    u = (query.to(stat_dtype) * norm_weight.to(stat_dtype)).view(heads, d // heads)
    logits = []
    for v in sources:
        rms = torch.linalg.vector_norm(v, dim=-1, keepdim=True, dtype=stat_dtype) * d**-0.5
        logits.append((v.unflatten(-1, (heads, d // heads)) * u).sum(-1) * torch.rsqrt(rms.square() + eps))
    return torch.stack(logits, dim=-1)


def depth_weights(
    sources: Sequence[Tensor], query: Tensor, norm_weight: Tensor, heads: int, eps: float = 1e-6
) -> Tensor:
    """The softmax over depth, per head: [..., heads, len(sources)]."""
    return torch.softmax(depth_logits(sources, query, norm_weight, heads, eps), dim=-1)


def _mix(weights: Tensor, sources: Sequence[Tensor], heads: int) -> Tensor:
    """sum_n weights[..., h, n] * v_n[h], in the promoted dtype of the sources."""
    d = sources[0].shape[-1]
    out = sum(weights[..., n, None] * v.unflatten(-1, (heads, d // heads)) for n, v in enumerate(sources))
    return out.flatten(-2).to(functools.reduce(torch.promote_types, (v.dtype for v in sources)))


def depth_route(
    sources: Sequence[Tensor],
    query: Tensor,
    norm_weight: Tensor,
    heads: int,
    eps: float = 1e-6,
) -> Tensor:
    """Mix `sources` ([..., d] each) with a per-head softmax over depth.

    logit[n, h] = query[h] . RMSNorm_g(v_n)[h]  (RMS over the full width, no 1/sqrt(d) scale);
    out[h] = sum_n softmax_n(logit[:, h]) * v_n[h].  The sources are never stacked, so saved
    activation memory stays linear in depth.  The output has the promoted dtype of the sources.
    A [Q, d] query (and norm weight) routes Q queries over the same sources: output [Q, ..., d].
    """
    out = depth_route_lse(sources, query, norm_weight, heads, eps)[0]
    return torch.stack(out) if query.dim() == 2 else out


def depth_route_lse(
    sources: Sequence[Tensor],
    query: Tensor,
    norm_weight: Tensor,
    heads: int,
    eps: float = 1e-6,
    counts: Sequence[int] | None = None,
) -> tuple[Tensor, Tensor] | tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """`depth_route` and the per-head log-sum-exp of its logits ([..., heads]).

    A [Q, d] query gives Q mixes and Q log-sum-exps, as two tuples; query k reads the first counts[k] sources
    (default: all; a [d] query is one query).
    """
    if query.dim() == 2:
        counts = check_counts(counts, len(query), len(sources))
        pairs = [
            depth_route_lse(sources[:c], q, g, heads, eps) for q, g, c in zip(query, norm_weight, counts, strict=True)
        ]
        return tuple(out for out, _ in pairs), tuple(lse for _, lse in pairs)
    sources = sources[: check_counts(counts, 1, len(sources))[0]]
    logits = depth_logits(sources, query, norm_weight, heads, eps)
    return _mix(torch.softmax(logits, dim=-1), sources, heads), torch.logsumexp(logits, dim=-1)


def merge_source(
    mix: Tensor, lse: Tensor, source: Tensor, query: Tensor, norm_weight: Tensor, heads: int, eps: float = 1e-6
) -> Tensor:
    """The route over [*sources, source] from the route over `sources` (its `mix` and `lse`), exactly.

    Adding one logit z to a softmax is a two-way softmax between the old mix and the new source:
    out = mix + sigmoid(z - lse) * (source - mix), per head. Sublayers that share most of their sources
    route over the shared part once and merge their own last source here.
    """
    d = query.shape[-1]
    z = depth_logits([source], query, norm_weight, heads, eps)[..., 0]
    weight = torch.sigmoid(z - lse)[..., None]
    old = mix.unflatten(-1, (heads, d // heads))
    out = old + weight * (source.unflatten(-1, (heads, d // heads)) - old)
    return out.flatten(-2).to(torch.promote_types(mix.dtype, source.dtype))


def merge_norm(
    mix: Tensor,
    lse: Tensor,
    source: Tensor,
    query: Tensor,
    norm_weight: Tensor,
    heads: int,
    weight: Tensor,
    eps: float,
    norm_eps: float,
    out_dtype: torch.dtype,
) -> Tensor:
    """`rms_norm(merge_source(...), weight, norm_eps)` in `out_dtype`: a merged read and the pre-norm of the
    sublayer that reads it."""
    return rms_norm(merge_source(mix, lse, source, query, norm_weight, heads, eps), weight, norm_eps).to(out_dtype)
