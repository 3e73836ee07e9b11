"""Checks of what a routing call is asked: heads that split the width, and how many leading sources each query reads."""

from collections.abc import Sequence


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
