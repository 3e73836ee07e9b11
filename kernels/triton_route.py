"""Fused Triton kernels for depth routing (forward and backward) and their launchers.

Sources reach the kernels through a pointer table (address, two leading strides and a dtype tag
per source), so the history is never concatenated. Every kernel works on whole rows (tokens) held
as a [heads, head size] register tile, so the full-width RMS that couples the heads is a plain
reduction and per-head values broadcast without gathers. The forward and the backward statistics
run one program per row over all sources; the backward then writes each source's gradient from
small per-(row, source) coefficients, one program per (block of rows, source).
"""

import functools
import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

_TAGS = {torch.float32: 0, torch.bfloat16: 1}  # dtype tag per source in the table (the kernels test 0 / 1)


@triton.jit
def _ptr(base, dtype: tl.constexpr, ALIGN: tl.constexpr):
    """Typed pointer from an address; ALIGN promises 16-byte alignment, so loads become 16-byte vectors."""
    p = base.to(tl.pointer_type(dtype))
    if ALIGN:
        p = tl.multiple_of(p, 16)
    return p


@triton.jit
def _issue(table, n, ok, i0, i1, cols, mask, KIND: tl.constexpr, ALIGN: tl.constexpr):
    """Start loading row (i0, i1) of source n as stored; `_value` turns the pair into fp32 where it is used,
    so the loads stay in flight until then. KIND (per launch, from the dtype tags): 0 every such source
    is fp32, 1 bf16, 2 either (two masked loads, chosen by the source's tag)."""
    entry = table + 5 * n
    off = i0 * tl.load(entry + 1) + i1 * tl.load(entry + 2)
    if ALIGN:
        off = tl.multiple_of(off, 8)
    base = tl.load(entry)
    if KIND == 0:
        x32 = tl.load(_ptr(base, tl.float32, ALIGN) + off + cols, mask=tl.where(ok, mask, False), other=0.0)
        x16 = x32
    elif KIND == 1:
        x16 = tl.load(_ptr(base, tl.bfloat16, ALIGN) + off + cols, mask=tl.where(ok, mask, False), other=0.0)
        x32 = x16
    else:
        tag = tl.load(entry + 3)
        m32, m16 = tl.where(ok & (tag == 0), mask, False), tl.where(ok & (tag == 1), mask, False)
        x32 = tl.load(_ptr(base, tl.float32, ALIGN) + off + cols, mask=m32, other=0.0)
        x16 = tl.load(_ptr(base, tl.bfloat16, ALIGN) + off + cols, mask=m16, other=0.0)
    return x32, x16


@triton.jit
def _value(x32, x16, KIND: tl.constexpr):
    """The fp32 row from what `_issue` loaded."""
    if KIND == 0:
        x = x32
    elif KIND == 1:
        x = x16.to(tl.float32)
    else:
        x = x32 + x16.to(tl.float32)
    return x


@triton.jit
def _store(table, n, row, D, cols, mask, x, ALIGN: tl.constexpr):
    """Store an fp32 row into the gradient buffer of source n (contiguous, the source's dtype).

    A branch rather than two masked stores: the fp32 store may need its own register layout, and
    the branch not taken costs nothing."""
    base = tl.load(table + 5 * n + 4)
    off = row * D
    if tl.load(table + 5 * n + 3) == 0:
        tl.store(_ptr(base, tl.float32, ALIGN) + off + cols, x, mask=mask)
    else:
        tl.store(_ptr(base, tl.bfloat16, ALIGN) + off + cols, x.to(tl.bfloat16), mask=mask)


@triton.jit
def _row_tile(u_ptr, Q, H, DH, D, BQ: tl.constexpr, BH: tl.constexpr, BDH: tl.constexpr):
    """The [heads, head size] tile of one row (head index, mask, column offsets) and the folded queries as a
    [queries, heads, head size] tile with their query index and mask."""
    h = tl.arange(0, BH)
    j = tl.arange(0, BDH)
    mask = (h < H)[:, None] & (j < DH)[None, :]
    cols = h[:, None] * DH + j[None, :]
    qi = tl.arange(0, BQ)
    qmask = (qi < Q)[:, None, None] & mask[None, :, :]
    u = tl.load(u_ptr + qi[:, None, None] * D + cols[None, :, :], mask=qmask, other=0.0)
    return h, mask, cols, qi, qmask, u


@triton.jit
def _mix_step(x, u, m, z_sum, acc, D, eps):
    """Online-softmax update of every query's per-head running max, normaliser and mix with one more source
    row x (the RMS is shared by the queries)."""
    r = tl.rsqrt(tl.sum(x * x) / D + eps)
    z = r * tl.sum(x[None, :, :] * u, axis=2)
    m_new = tl.maximum(m, z)
    alpha = tl.exp(m - m_new)
    e = tl.exp(z - m_new)
    return m_new, z_sum * alpha + e, acc * alpha[:, :, None] + e[:, :, None] * x[None, :, :]


@triton.jit
def _forward_kernel(
    table, S, Q, u_ptr, out_ptr, lse_ptr, M, M1, D, H, DH, eps,
    BQ: tl.constexpr, BH: tl.constexpr, BDH: tl.constexpr, K0: tl.constexpr, KR: tl.constexpr, ALIGN: tl.constexpr,
):  # fmt: skip
    """One row per program, all queries at once: source 0 (kind K0), then sources 1.. (kind KR) with two
    loads in flight."""
    row = tl.program_id(0).to(tl.int64)
    i0 = row // M1
    i1 = row % M1
    h, mask, cols, qi, qmask, u = _row_tile(u_ptr, Q, H, DH, D, BQ, BH, BDH)
    x32, x16 = _issue(table, 0, True, i0, i1, cols, mask, K0, ALIGN)
    a32, a16 = _issue(table, 1 % S, 1 < S, i0, i1, cols, mask, KR, ALIGN)
    b32, b16 = _issue(table, 2 % S, 2 < S, i0, i1, cols, mask, KR, ALIGN)
    m, z_sum = tl.full([BQ, BH], float("-inf"), tl.float32), tl.zeros([BQ, BH], tl.float32)
    acc = tl.zeros([BQ, BH, BDH], tl.float32)
    m, z_sum, acc = _mix_step(_value(x32, x16, K0), u, m, z_sum, acc, D, eps)
    for n in range(1, S):
        c32, c16 = _issue(table, (n + 2) % S, n + 2 < S, i0, i1, cols, mask, KR, ALIGN)
        m, z_sum, acc = _mix_step(_value(a32, a16, KR), u, m, z_sum, acc, D, eps)
        a32, a16, b32, b16 = b32, b16, c32, c16
    out = acc / z_sum[:, :, None]
    at = qi[:, None, None] * (M * D) + row * D + cols[None, :, :]
    tl.store(out_ptr + at, out.to(out_ptr.dtype.element_ty), mask=qmask)
    hq = qi[:, None] * (M * H) + row * H + h[None, :]
    tl.store(lse_ptr + hq, m + tl.log(z_sum), mask=(qi < Q)[:, None] & (h < H)[None, :])


@triton.jit
def _stats_step(x, u, go, lse, delta, at, hmask, r_at, p_ptr, q_ptr, c_ptr, D, eps):
    """For one source row x: store z, s and r (in the p, q, c buffers) and add p s to delta."""
    r = tl.rsqrt(tl.sum(x * x) / D + eps)
    z = r * tl.sum(x[None, :, :] * u, axis=2)
    s = tl.sum(go * x[None, :, :], axis=2)
    tl.store(p_ptr + at, z, mask=hmask)
    tl.store(q_ptr + at, s, mask=hmask)
    tl.store(c_ptr + r_at, r)
    return delta + tl.exp(z - lse) * s


@triton.jit
def _backward_stats_kernel(
    table, S, Q, u_ptr, gout_ptr, glse_ptr, lse_ptr, p_ptr, q_ptr, c_ptr, M, M1, D, H, DH, eps,
    BQ: tl.constexpr, BH: tl.constexpr, BDH: tl.constexpr, K0: tl.constexpr, KR: tl.constexpr, ALIGN: tl.constexpr,
    HAS_GLSE: tl.constexpr,
):  # fmt: skip
    """Per row (one program each, like the forward), the coefficients of every source's gradient, per query k:
    p[n, k, h] (softmax weight), q[n, k, h] = r[n] dz[n, k, h] and c[n] = -r[n]^2 / D sum_k,h dz z, where
    dz = p (s - delta + g), s[n, k, h] = <go_k[h], v_n[h]>, delta[k, h] = sum_n p s = <go_k[h], mix_k[h]>
    (exact, without reading a rounded mix) and g[k, h] the upstream gradient of the log-sum-exp (HAS_GLSE;
    else 0). The loop over sources leaves z, s and r in the p, q and c
    buffers; once delta is complete, a second loop over those small values turns them into p, q and c.
    """
    row = tl.program_id(0).to(tl.int64)
    i0 = row // M1
    i1 = row % M1
    h, mask, cols, qi, qmask, u = _row_tile(u_ptr, Q, H, DH, D, BQ, BH, BDH)
    x32, x16 = _issue(table, 0, True, i0, i1, cols, mask, K0, ALIGN)
    a32, a16 = _issue(table, 1 % S, 1 < S, i0, i1, cols, mask, KR, ALIGN)
    b32, b16 = _issue(table, 2 % S, 2 < S, i0, i1, cols, mask, KR, ALIGN)
    go = tl.load(gout_ptr + qi[:, None, None] * (M * D) + row * D + cols[None, :, :], mask=qmask, other=0.0)
    go = go.to(tl.float32)
    hmask = (qi < Q)[:, None] & (h < H)[None, :]
    lse = tl.load(lse_ptr + qi[:, None] * (M * H) + row * H + h[None, :], mask=hmask, other=0.0)
    qh = qi[:, None] * H + h[None, :]
    delta = tl.zeros([BQ, BH], tl.float32)
    x = _value(x32, x16, K0)
    delta = _stats_step(x, u, go, lse, delta, row * S * Q * H + qh, hmask, row * S, p_ptr, q_ptr, c_ptr, D, eps)
    for n in range(1, S):
        c32, c16 = _issue(table, (n + 2) % S, n + 2 < S, i0, i1, cols, mask, KR, ALIGN)
        at = (row * S + n) * Q * H + qh
        x = _value(a32, a16, KR)
        delta = _stats_step(x, u, go, lse, delta, at, hmask, row * S + n, p_ptr, q_ptr, c_ptr, D, eps)
        a32, a16, b32, b16 = b32, b16, c32, c16
    if HAS_GLSE:
        delta -= tl.load(glse_ptr + qi[:, None] * (M * H) + row * H + h[None, :], mask=hmask, other=0.0)
    tl.debug_barrier()  # the second loop reads values other threads of this program stored
    for n in range(S):
        at = (row * S + n) * Q * H + qh
        z = tl.load(p_ptr + at, mask=hmask, other=0.0)
        p = tl.exp(z - lse)
        dz = p * (tl.load(q_ptr + at, mask=hmask, other=0.0) - delta)
        r = tl.load(c_ptr + row * S + n)
        tl.debug_barrier()  # every thread has read z, s and r before any overwrites them
        tl.store(p_ptr + at, p, mask=hmask)
        tl.store(q_ptr + at, r * dz, mask=hmask)
        tl.store(c_ptr + row * S + n, -r * r / D * tl.sum(tl.sum(tl.where(hmask, dz * z, 0.0), axis=1)))


@triton.jit
def _apply_rows(
    table, S, Q, n, first, count, u, h, mask, cols, qi, qmask, gout_ptr, p_ptr, q_ptr, c_ptr, M, M1, D, H,
    BQ: tl.constexpr, BH: tl.constexpr, BDH: tl.constexpr, KIND: tl.constexpr, ALIGN: tl.constexpr,
):  # fmt: skip
    """Write dv_n for rows first.. first + count - 1 of source n (of kind KIND); return their sum of q v_n
    per query."""
    du = tl.zeros([BQ, BH, BDH], tl.float32)
    hmask = (qi < Q)[:, None] & (h < H)[None, :]
    qh = qi[:, None] * H + h[None, :]
    for i in range(count):
        row = first + i
        at = (row * S + n) * Q * H + qh
        p = tl.load(p_ptr + at, mask=hmask, other=0.0)[:, :, None]
        q = tl.load(q_ptr + at, mask=hmask, other=0.0)[:, :, None]
        c = tl.load(c_ptr + row * S + n)
        go = tl.load(gout_ptr + qi[:, None, None] * (M * D) + row * D + cols[None, :, :], mask=qmask, other=0.0)
        x32, x16 = _issue(table, n, True, row // M1, row % M1, cols, mask, KIND, ALIGN)
        x = _value(x32, x16, KIND)
        _store(table, n, row, D, cols, mask, tl.sum(p * go.to(tl.float32) + q * u, axis=0) + c * x, ALIGN)
        du += q * x[None, :, :]
    return du


@triton.jit
def _backward_apply_kernel(
    table, S, Q, u_ptr, gout_ptr, p_ptr, q_ptr, c_ptr, du_ptr, M, M1, D, H, DH, BR: tl.constexpr,
    BQ: tl.constexpr, BH: tl.constexpr, BDH: tl.constexpr, K0: tl.constexpr, KR: tl.constexpr, ALIGN: tl.constexpr,
):  # fmt: skip
    """dv_n = sum_k (p[n, k, h] go_k + q[n, k, h] u_k) + c[n] v_n for BR rows of source n, and their partial
    sums of du_k = sum over rows of q[n, k, h] v_n (reduced over row blocks by the caller).

    Rows are [heads, head size] tiles as in the forward, so the per-head coefficients broadcast
    without gathers and addresses are computed once per 16-byte vector.
    """
    n = tl.program_id(0) % S
    first = (tl.program_id(0) // S).to(tl.int64) * BR
    count = tl.minimum(M - first, BR)
    h, mask, cols, qi, qmask, u = _row_tile(u_ptr, Q, H, DH, D, BQ, BH, BDH)
    if n == 0:  # uniform per program: each branch loads with its own kind
        du = _apply_rows(
            table, S, Q, n, first, count, u, h, mask, cols, qi, qmask, gout_ptr, p_ptr, q_ptr, c_ptr, M, M1, D, H,
            BQ, BH, BDH, K0, ALIGN,
        )  # fmt: skip
    else:
        du = _apply_rows(
            table, S, Q, n, first, count, u, h, mask, cols, qi, qmask, gout_ptr, p_ptr, q_ptr, c_ptr, M, M1, D, H,
            BQ, BH, BDH, KR, ALIGN,
        )  # fmt: skip
    at = tl.program_id(0).to(tl.int64) * Q * D + qi[:, None, None] * D + cols[None, :, :]
    tl.store(du_ptr + at, du, mask=qmask)


ROW_ELEMS_PER_THREAD = 16  # row-tile elements per thread (sets the warps): 16 is faster than 8 at d = 2048
APPLY_ROWS = 32  # rows per gradient program; sets the shape of du's partial sums, so change it before compiling


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _rows(v: Tensor, lead: torch.Size) -> tuple[Tensor, int, int]:
    """A [outer, inner, d] view of `v` (rows addressed by two strides, stride 0 allowed); copies only if
    no such view exists or the dtype is neither fp32 nor bf16."""
    if v.dim() == 3 and v.stride(-1) == 1 and v.dtype in _TAGS:  # [B, T, d]: the common case, as is
        return v, v.stride(0), v.stride(1)
    if v.dtype not in _TAGS:
        v = v.float()
    inner = lead[-1] if len(lead) else 1
    outer = v.numel() // max(v.shape[-1] * inner, 1)
    if v.stride(-1) != 1:
        v = v.contiguous()
    try:
        v2 = v.view(outer, inner, v.shape[-1])
    except RuntimeError:
        v2 = v.reshape(outer, inner, v.shape[-1])
    return v2, v2.stride(0), v2.stride(1)


_TABLES: dict[tuple, tuple[Tensor, bool, int, int]] = {}  # pointer tables by content: the allocator reuses addresses
_TABLES_MAX = 4096


def _table(
    sources: Sequence[Tensor], lead: torch.Size, grads: Sequence[Tensor] = ()
) -> tuple[Tensor, list[Tensor], bool, int, int]:
    """The int64 [S, 5] table (address, stride0, stride1, dtype tag, gradient address) of the sources.

    Returns it with the views it points into (kept alive until launch), whether every address and
    row offset is 16-byte aligned, and the load kinds of source 0 and of the others (see `_issue`).
    A table is a pure function of its content, so it is built once (in pinned memory, copied without a
    sync) and then reused from a cache keyed by that content and the stream. Cached tables may be freed,
    and a graph replay would re-read freed memory, so capture into a CUDA graph is refused.
    """
    device = sources[0].device
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "fused depth routing cannot be captured in a CUDA graph (its pointer tables live on the host side); "
            "compile without mode='reduce-overhead' or use MHAR_ROUTE_BACKEND=reference"
        )
    views, entries = [], []
    for n, v in enumerate(sources):
        v2, s0, s1 = _rows(v, lead)
        views.append(v2)
        entries += (v2.data_ptr(), s0, s1, _TAGS[v2.dtype], grads[n].data_ptr() if grads else 0)
    stream = torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0  # cheap: no Stream object
    key = (device, stream, views[0].shape[-1], *entries)
    if key not in _TABLES:
        if len(_TABLES) >= _TABLES_MAX:
            _TABLES.clear()
        aligned = key[2] % 8 == 0 and all(
            x % (16 if k in (0, 4) else 8) == 0 for i, x in enumerate(entries) if (k := i % 5) != 3
        )
        tags = set(entries[8::5]) or {entries[3]}
        table = torch.tensor(entries, dtype=torch.int64, pin_memory=device.type == "cuda")
        _TABLES[key] = table.to(device, non_blocking=True), aligned, entries[3], tags.pop() if len(tags) == 1 else 2
    table, aligned, k0, kr = _TABLES[key]
    return table, views, aligned, k0, kr


@functools.cache
def _launch_shape(
    d: int, heads: int, queries: int, elems_per_thread: int, interpreted: bool
) -> tuple[int, int, int, int]:
    """Tiles [queries, heads, head size] padded to powers of two, and warps giving `elems_per_thread` per
    thread in the largest tile (the per-query ones)."""
    bq = triton.next_power_of_2(queries)
    bh = triton.next_power_of_2(heads)
    bdh = triton.next_power_of_2(d // heads)
    warps = 1 if interpreted else min(16, max(4, bq * bh * bdh // (32 * elems_per_thread)))
    return bq, bh, bdh, warps


def du_blocks(rows: int, n_sources: int) -> int:
    """Rows of the partial sums of du that `route_backward` returns: one per program of the gradient kernel."""
    return triton.cdiv(rows, APPLY_ROWS) * n_sources


def out_dtype(sources: Sequence[Tensor]) -> torch.dtype:
    """The output dtype of a route: bf16 when every source is bf16, fp32 otherwise."""
    return torch.bfloat16 if all(v.dtype == torch.bfloat16 for v in sources) else torch.float32


def route_forward(
    sources: Sequence[Tensor], u: Tensor, heads: int, eps: float, out: Tensor | None = None, lse: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Forward route for Q folded queries `u = query * norm_weight` (fp32, [Q, d]) in one pass over the sources.

    Returns the mixes [Q, ..., d] (bf16 if all sources are bf16, else fp32) and the per-head
    log-sum-exps [Q, ..., heads] in fp32. `out` / `lse` may be given as destination buffers.
    """
    lead, d = sources[0].shape[:-1], sources[0].shape[-1]
    n_queries = u.shape[0]
    table, views, aligned, k0, kr = _table(sources, lead)
    rows = lead.numel()
    if out is None:
        out = torch.empty(n_queries, *lead, d, dtype=out_dtype(sources), device=u.device)
    if lse is None:
        lse = torch.empty(n_queries, *lead, heads, dtype=torch.float32, device=u.device)
    bq, bh, bdh, warps = _launch_shape(d, heads, n_queries, ROW_ELEMS_PER_THREAD, _interpreted())
    if rows:
        _forward_kernel[(rows,)](
            table, len(sources), n_queries, u.contiguous(), out, lse, rows, views[0].shape[1], d, heads, d // heads,
            eps, BQ=bq, BH=bh, BDH=bdh, K0=k0, KR=kr,
            ALIGN=aligned and (d // heads) % 8 == 0, num_warps=warps,
        )  # fmt: skip
    return out, lse


def route_backward(
    grad_out: Tensor,
    grad_lse: Tensor | None,
    lse: Tensor,
    sources: Sequence[Tensor],
    u: Tensor,
    heads: int,
    eps: float,
    grads: Sequence[Tensor] | None = None,
) -> tuple[list[Tensor], Tensor]:
    """Gradients of the route of Q queries (`grad_out` [Q, ..., d], and `grad_lse` [Q, ..., heads] or None when
    the log-sum-exps are not used): one per source (its dtype, contiguous,
    summed over the queries) and the partial sums of du = dL/d(query * norm_weight), [du_blocks(rows, S), Q, d]
    in fp32 (their sum over dim 0 is du).

    Two kernels: per-row coefficients (one program per row, reading every source once), then one program
    per (block of rows, source) writing that source's gradient and its block's partial sum of du, so du
    is reduced deterministically, without atomics.
    """
    lead, d = sources[0].shape[:-1], sources[0].shape[-1]
    n_queries = u.shape[0]
    if grads is None:
        dtypes = [v.dtype if v.dtype in _TAGS else torch.float32 for v in sources]
        grads = [torch.empty(*lead, d, dtype=dt, device=u.device) for dt in dtypes]
    rows, S, dh = lead.numel(), len(sources), d // heads
    du = torch.empty(du_blocks(rows, S), n_queries, d, dtype=torch.float32, device=u.device)
    if rows == 0:
        return list(grads), du
    table, views, aligned, k0, kr = _table(sources, lead, grads)
    align = aligned and dh % 8 == 0
    grad_out, lse, u = grad_out.contiguous(), lse.contiguous(), u.contiguous()
    glse = lse if grad_lse is None else grad_lse.contiguous()  # any fp32 pointer when unused
    p = torch.empty(rows, S, n_queries, heads, dtype=torch.float32, device=u.device)
    q = torch.empty_like(p)
    c = torch.empty(rows, S, dtype=torch.float32, device=u.device)
    bq, bh, bdh, warps = _launch_shape(d, heads, n_queries, ROW_ELEMS_PER_THREAD, _interpreted())
    _backward_stats_kernel[(rows,)](
        table, S, n_queries, u, grad_out, glse, lse, p, q, c, rows, views[0].shape[1], d, heads, dh, eps,
        BQ=bq, BH=bh, BDH=bdh, K0=k0, KR=kr, ALIGN=align, HAS_GLSE=grad_lse is not None, num_warps=warps,
    )  # fmt: skip
    _backward_apply_kernel[(du.shape[0],)](
        table, S, n_queries, u, grad_out, p, q, c, du, rows, views[0].shape[1], d, heads, dh,
        BR=APPLY_ROWS, BQ=bq, BH=bh, BDH=bdh, K0=k0, KR=kr, ALIGN=align, num_warps=warps,
    )  # fmt: skip
    return list(grads), du
