"""Launch settings and host launchers of the routing kernels: `route_forward` and `route_backward` are the bodies of
the `mhar::depth_route` and `mhar::depth_route_backward` ops (`op.py`)."""

import functools
import os
from collections.abc import Sequence

import torch
import triton
from mhar_lightning.kernels.backward_kernels import _backward_apply_kernel, _backward_stats_kernel
from mhar_lightning.kernels.forward_kernel import _forward_kernel
from mhar_lightning.kernels.query import check_counts
from mhar_lightning.kernels.rows import DTYPE_TAGS, pointer_table
from torch import Tensor

MAX_QUERIES = 2  # queries per kernel call: the two sublayers of a transformer block
ROW_ELEMS_PER_THREAD = 16  # row-tile elements per thread (sets the warps): 16 is faster than 8 at d = 2048
MIN_WARPS = {"forward": 4, "stats": 1, "apply": 4}  # per kernel: 2 warps at d = 1024 speed up only the statistics
ONE_WARP_TILE = {"forward": 1024, "stats": 0, "apply": 0}  # per kernel: a row tile up to this size runs in one warp
# (no barriers between warps): the forward at d = 1024 runs 9-15 % faster so, while at d = 2048 two warps are slower
# than four; the statistics and gradient kernels are slower in one warp (the latter spills)
LAZY_RESCALE_WARPS = 1  # the forward rescales lazily (`_mix_step`) at up to this many warps, where the decision
# needs no barrier: 2-7 % faster in one warp; at four warps it adds 6 barriers a source
STATS_SOURCES = 8  # sources per step of the statistics kernel's second loop (a [sources, heads] tile)
APPLY_ROWS = 32  # rows per gradient program; sets the shape of du's partial sums, so change it before compiling


def interpreted() -> bool:
    """Whether Triton kernels run in its CPU interpreter (`TRITON_INTERPRET=1`, the test setup)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def launch_shape(
    d: int, heads: int, elems_per_thread: int, min_warps: int, interpreter: bool, one_warp_tile: int = 0
) -> tuple[int, int, int]:
    """Tile [heads, head size] padded to powers of two, and warps giving `elems_per_thread` per tile (at least
    `min_warps`), or one warp for a tile of at most `one_warp_tile` elements."""
    bh = triton.next_power_of_2(heads)
    bdh = triton.next_power_of_2(d // heads)
    if interpreter or bh * bdh <= one_warp_tile:
        return bh, bdh, 1
    warps = min(16, max(min_warps, bh * bdh // (32 * elems_per_thread)))
    return bh, bdh, warps


def kernel_launch(kernel: str, d: int, heads: int) -> tuple[int, int, int]:
    """`launch_shape` with the settings of `kernel` ("forward", "stats" or "apply")."""
    return launch_shape(d, heads, ROW_ELEMS_PER_THREAD, MIN_WARPS[kernel], interpreted(), ONE_WARP_TILE[kernel])


def lazy_rescale(warps: int) -> bool:
    """Whether a forward launch of `warps` warps rescales its mix lazily (its `LAZY` constexpr)."""
    return warps <= LAZY_RESCALE_WARPS


def _check_queries(u: Tensor, counts: Sequence[int], n_sources: int) -> tuple[int, int, int]:
    """The number of queries and the sources each reads (`counts`: leading sources per query, all if empty)."""
    n_queries = u.shape[0]
    if not 1 <= n_queries <= MAX_QUERIES:
        raise ValueError(f"the kernels take 1 to {MAX_QUERIES} queries per call, got {n_queries}; split them")
    counts = check_counts(counts or None, n_queries, n_sources)
    return n_queries, counts[0], counts[-1]


def du_blocks(rows: int, n_sources: int) -> int:
    """Rows of the partial sums of du that `route_backward` returns: one per program of the gradient kernel."""
    return triton.cdiv(rows, APPLY_ROWS) * n_sources


def out_dtype(sources: Sequence[Tensor]) -> torch.dtype:
    """The output dtype of a route: bf16 when every source is bf16, fp32 otherwise."""
    return torch.bfloat16 if all(v.dtype == torch.bfloat16 for v in sources) else torch.float32


def route_forward(
    sources: Sequence[Tensor],
    u: Tensor,
    heads: int,
    eps: float,
    counts: Sequence[int] = (),
    out: Sequence[Tensor] | None = None,
    lse: Tensor | None = None,
    rms: Tensor | None = None,
) -> tuple[list[Tensor], Tensor, Tensor]:
    """Forward route for 1 or 2 folded queries `u = query * norm_weight` (fp32, [Q, d]) in one pass over the sources;
    query k reads the first counts[k] sources (all when `counts` is empty).

    Returns the Q mixes, each [..., d] in its own buffer (bf16 if all sources are bf16, else fp32), the per-head
    log-sum-exps [Q, ..., heads] in fp32 and the sources' inverse RMS [rows, S] in fp32 (for `route_backward`).
    `out` (Q contiguous tensors), `lse` and `rms` may be given as destination buffers.
    """
    lead, d = sources[0].shape[:-1], sources[0].shape[-1]
    n_queries, s0, s1 = _check_queries(u, counts, len(sources))
    table, views, aligned, k0, kr = pointer_table(sources, lead)
    rows = lead.numel()
    if out is None:
        out = [torch.empty(*lead, d, dtype=out_dtype(sources), device=u.device) for _ in range(n_queries)]
    if lse is None:
        lse = torch.empty(n_queries, *lead, heads, dtype=torch.float32, device=u.device)
    if rms is None:
        rms = torch.empty(rows, len(sources), dtype=torch.float32, device=u.device)
    bh, bdh, warps = kernel_launch("forward", d, heads)
    if rows:
        _forward_kernel[(rows,)](
            table, len(sources), s0, s1, u.contiguous(), out[0], out[-1], lse, rms, rows, views[0].shape[1], d, heads,
            d // heads, eps,
            BH=bh, BDH=bdh, K0=k0, KR=kr, ALIGN=aligned and (d // heads) % 8 == 0, Q=n_queries,
            LAZY=lazy_rescale(warps), num_warps=warps,
        )  # fmt: skip
    return list(out), lse, rms


def _gradient_offsets(grad_out: Sequence[Tensor], d: int) -> tuple[Tensor, Tensor, int, int]:
    """Query 0's and the last query's gradients (contiguous, in query 0's dtype; keep both alive until launch) and
    where the last starts relative to the first, in rows of d and elements: the kernels read it at
    gout + (G1R + row) * D + G1E. That address, rather than a second pointer, keeps the gradient kernel's loop
    scheduled as when both gradients shared one buffer: about 20 % faster at d = 1024 on an H200."""
    first = grad_out[0].contiguous()
    last = grad_out[-1].to(first.dtype).contiguous()
    g1r, g1e = divmod((last.data_ptr() - first.data_ptr()) // first.element_size(), d)
    return first, last, g1r, g1e


def route_backward(
    grad_out: Sequence[Tensor],
    grad_lse: Tensor | None,
    lse: Tensor,
    rms: Tensor,
    sources: Sequence[Tensor],
    u: Tensor,
    heads: int,
    counts: Sequence[int] = (),
    grads: Sequence[Tensor] | None = None,
) -> tuple[list[Tensor], Tensor]:
    """Gradients of the route of Q queries, query k reading the first counts[k] sources (`grad_out`: one [..., d]
    gradient per mix; `grad_lse` [Q, ..., heads], or None when the log-sum-exps are not used; `lse` and `rms` from
    `route_forward`): one per source (its dtype, contiguous, summed over the queries) and the partial sums of
    du = dL/d(query * norm_weight), [du_blocks(rows, S), Q, d] in fp32 (their sum over dim 0 is du).

    Two kernels: per-row coefficients (one program per row, reading every source once), then one program
    per (block of rows, source) writing that source's gradient and its block's partial sum of du, so du
    is reduced deterministically, without atomics.
    """
    lead, d = sources[0].shape[:-1], sources[0].shape[-1]
    n_queries, s0, s1 = _check_queries(u, counts, len(sources))
    if grads is None:
        dtypes = [v.dtype if v.dtype in DTYPE_TAGS else torch.float32 for v in sources]
        grads = [torch.empty(*lead, d, dtype=dt, device=u.device) for dt in dtypes]
    rows, S, dh = lead.numel(), len(sources), d // heads
    du = torch.empty(du_blocks(rows, S), n_queries, d, dtype=torch.float32, device=u.device)
    if rows == 0:
        return list(grads), du
    table, views, aligned, k0, kr = pointer_table(sources, lead, grads)
    align = aligned and dh % 8 == 0
    gout, _last, g1r, g1e = _gradient_offsets(grad_out, d)
    lse, u = lse.contiguous(), u.contiguous()
    glse = lse if grad_lse is None else grad_lse.contiguous()  # any fp32 pointer when unused
    pq = torch.empty(rows, S, 2, n_queries, heads, dtype=torch.float32, device=u.device)
    p, q = pq[:, :, 0], pq[:, :, 1]  # a source's p and q side by side: the statistics kernel stores both at once
    c = torch.empty(rows, S, dtype=torch.float32, device=u.device)
    bh, bdh, warps = kernel_launch("stats", d, heads)
    _backward_stats_kernel[(rows,)](
        table, S, s0, s1, u, gout, g1r, g1e, glse, lse, rms, p, q, c, rows, views[0].shape[1], d, heads, dh,
        BH=bh, BDH=bdh, K0=k0, KR=kr, ALIGN=align, HAS_GLSE=grad_lse is not None, Q=n_queries, SC=STATS_SOURCES,
        num_warps=warps,
    )  # fmt: skip
    warps = kernel_launch("apply", d, heads)[2]
    _backward_apply_kernel[(du.shape[0],)](
        table, S, u, gout, g1r, g1e, p, q, c, du, rows, views[0].shape[1], d, heads, dh,
        BR=APPLY_ROWS, BH=bh, BDH=bdh, K0=k0, KR=kr, ALIGN=align, Q=n_queries, num_warps=warps,
    )  # fmt: skip
    return list(grads), du
