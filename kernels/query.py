"""What a routing call is asked: its queries (`RouteQuery`) and how many leading sources each reads (`counts`)."""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

KEY_NORM_EPS = 1e-6  # the key RMSNorm's eps, DESIGN.md's default


def check_heads(d_model: int, heads: int) -> None:
    """Raise a one-line error unless `heads` splits `d_model` into equal chunks."""
    if heads < 1 or d_model % heads:
        divisors = [h for h in (1, 2, 4, 8, 16, 32) if d_model % h == 0]
        raise ValueError(f"heads={heads} must divide d_model={d_model}; use one of {divisors}")


def check_counts(counts: Sequence[int] | None, n_queries: int, n_sources: int) -> list[int]:
    """Leading sources per query (all by default); raise a one-line error unless each is 1 .. n_sources."""
    if counts is None:
        return [n_sources] * n_queries
    counts = [int(c) for c in counts]
    if len(counts) != n_queries or not all(1 <= c <= n_sources for c in counts):
        raise ValueError(f"counts={counts} must give 1 to {n_sources} sources for each of the {n_queries} queries")
    return counts


@dataclass(frozen=True)
class RouteQuery:
    """The queries of a routing call: pseudo-queries w (`query`) and key RMSNorm gains g (`norm_weight`), both [d]
    for one query or [Q, d] for Q queries over the same sources, split into `heads` chunks of d / heads, with the key
    norm's `eps`. Checked once, where it is made; the routing functions pass it on whole."""

    query: Tensor
    norm_weight: Tensor
    heads: int
    eps: float = KEY_NORM_EPS

    def __post_init__(self) -> None:
        check_heads(self.d, self.heads)

    @classmethod
    def of(
        cls,
        query: "Tensor | RouteQuery",
        norm_weight: Tensor | None = None,
        heads: int | None = None,
        eps: float | None = None,
    ) -> "RouteQuery":
        """`query` itself if it is a RouteQuery, else the RouteQuery of the four: what the public routing functions
        take as their query."""
        if isinstance(query, RouteQuery):
            if norm_weight is not None or heads is not None or eps is not None:
                raise TypeError("pass a RouteQuery alone, without norm_weight, heads or eps")
            return query
        if norm_weight is None or heads is None:
            raise TypeError("a query tensor needs norm_weight and heads (or pass a RouteQuery)")
        return cls(query, norm_weight, heads, KEY_NORM_EPS if eps is None else eps)

    @property
    def d(self) -> int:
        return self.query.shape[-1]

    @property
    def count(self) -> int:
        """The number of queries: 1 for a [d] query."""
        return 1 if self.query.dim() == 1 else self.query.shape[0]

    def __getitem__(self, k: int | slice) -> "RouteQuery":
        """Query k (or a slice of them) of a [Q, d] RouteQuery."""
        return RouteQuery(self.query[k], self.norm_weight[k], self.heads, self.eps)

    def folded(self, dtype: torch.dtype | None = None) -> Tensor:
        """u = w * g (in `dtype` if given): the gain folded into the query, w . (g * v) = (w * g) . v."""
        if dtype is None:
            return self.query * self.norm_weight
        return self.query.to(dtype) * self.norm_weight.to(dtype)

    def split_heads(self, x: Tensor) -> Tensor:
        """`x` [..., d] viewed as [..., heads, d / heads]."""
        return x.unflatten(-1, (self.heads, self.d // self.heads))
