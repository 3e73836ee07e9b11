"""The routing calls behind `mhar_lightning.kernels` (whose docstring states what they compute): each picks the
pure-PyTorch reference or the fused Triton op."""

import importlib.util
import os
from collections.abc import Sequence

import torch
from mhar_lightning.kernels import reference
from mhar_lightning.kernels.query import KEY_NORM_EPS, RouteQuery
from torch import Tensor

BACKENDS = ("auto", "triton", "reference")
ENV_BACKEND = "MHAR_ROUTE_BACKEND"
HAS_TRITON = importlib.util.find_spec("triton") is not None


def resolve_backend(backend: str, sources: Sequence[Tensor]) -> str:
    """The backend a call runs on: `triton` or `reference`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; use one of {BACKENDS}")
    if backend == "auto":
        backend = os.environ.get(ENV_BACKEND, "auto") or "auto"
        if backend not in BACKENDS:
            raise ValueError(f"{ENV_BACKEND}={backend!r}; use one of {BACKENDS}")
    if backend == "auto":
        return "triton" if HAS_TRITON and len(sources) and sources[0].is_cuda else "reference"
    if backend == "triton":
        if not HAS_TRITON:
            raise RuntimeError("backend='triton' needs the triton package")
        if len(sources) and not sources[0].is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1")
    return backend


def depth_route(
    sources: Sequence[Tensor],
    query: Tensor | RouteQuery,
    norm_weight: Tensor | None = None,
    heads: int | None = None,
    eps: float | None = None,
    backend: str = "auto",
) -> Tensor:
    """The mix `out` of `sources` ([..., d] each) on the chosen backend: [..., d], or [Q, ..., d] for [Q, d] queries.

    The queries are a `RouteQuery`, or `query, norm_weight, heads[, eps]` to make one (as for every function here).
    """
    route = RouteQuery.of(query, norm_weight, heads, eps)
    if resolve_backend(backend, sources) == "reference":
        return reference.depth_route(sources, route)
    from mhar_lightning.kernels import op

    return op.depth_route(sources, route)


def depth_route_lse(
    sources: Sequence[Tensor],
    query: Tensor | RouteQuery,
    norm_weight: Tensor | None = None,
    heads: int | None = None,
    eps: float | None = None,
    counts: Sequence[int] | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor] | tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """`depth_route` and its per-head log-sum-exp, for `merge_source` to add a later source. [Q, d] queries give a
    tuple of Q mixes and one of Q log-sum-exps, query k reading the first counts[k] sources (default: all)."""
    route = RouteQuery.of(query, norm_weight, heads, eps)
    if resolve_backend(backend, sources) == "reference":
        return reference.depth_route_lse(sources, route, counts=counts)
    from mhar_lightning.kernels import op

    return op.depth_route_lse(sources, route, counts)


merge_source = reference.merge_source


def merge_norm(
    mix: Tensor,
    lse: Tensor,
    source: Tensor,
    query: Tensor | RouteQuery,
    norm_weight: Tensor | None = None,
    heads: int | None = None,
    weight: Tensor | None = None,
    eps: float | None = None,
    norm_eps: float = 1e-5,
    backend: str = "auto",
) -> Tensor:
    """`merge_source` followed by the RMSNorm of gain `weight` (required) and `norm_eps` (see
    `reference.merge_norm`), differentiated by one fused kernel on the Triton backend. The output comes in the dtype
    the sublayer's matmuls take: the autocast dtype while autocast is on, else what `weight * merged` promotes to."""
    route = RouteQuery.of(query, norm_weight, heads, eps)
    if weight is None:
        raise TypeError("merge_norm needs the norm's gain: weight=")
    device = mix.device.type
    if torch.is_autocast_enabled(device):
        out_dtype = torch.get_autocast_dtype(device)
    else:
        out_dtype = torch.promote_types(weight.dtype, torch.promote_types(mix.dtype, source.dtype))
    if resolve_backend(backend, [mix]) == "reference":
        return reference.merge_norm(mix, lse, source, route, weight, norm_eps, out_dtype)
    from mhar_lightning.kernels import op

    return op.merge_norm(mix, lse, source, route, weight, norm_eps, out_dtype)


__all__ = [
    "BACKENDS",
    "ENV_BACKEND",
    "KEY_NORM_EPS",
    "RouteQuery",
    "depth_route",
    "depth_route_lse",
    "merge_norm",
    "merge_source",
    "reference",
    "resolve_backend",
]
