"""Fused Triton kernels for depth routing (forward and backward) and their launchers.

Sources reach the kernels through a pointer table (address, two leading strides and a dtype tag
per source), so the history is never concatenated. Every kernel works on whole rows (tokens) held
as a [heads, head size] register tile, so the full-width RMS that couples the heads is a plain
reduction and per-head values broadcast without gathers. The forward and the backward statistics
run one program per row over all sources; the backward then writes each source's gradient from
small per-(row, source) coefficients, one program per (block of rows, source).
"""

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
def _issue(table, S, n, ok, i0, i1, cols, mask, ALIGN: tl.constexpr):
    """Start loading row (i0, i1) of source n: (fp32 part, bf16 part), one of them all zeros.

    The parts are combined only where the row is used, so the loads stay in flight until then.
    """
    base = tl.load(table + n)
    off = i0 * tl.load(table + S + n) + i1 * tl.load(table + 2 * S + n)
    if ALIGN:
        off = tl.multiple_of(off, 8)
    tag = tl.load(table + 3 * S + n)
    x32 = tl.load(_ptr(base, tl.float32, ALIGN) + off + cols, mask=tl.where(ok & (tag == 0), mask, False), other=0.0)
    x16 = tl.load(_ptr(base, tl.bfloat16, ALIGN) + off + cols, mask=tl.where(ok & (tag == 1), mask, False), other=0.0)
    return x32, x16


@triton.jit
def _store(table, S, n, row, D, cols, mask, x, ALIGN: tl.constexpr):
    """Store an fp32 row into the gradient buffer of source n (contiguous, the source's dtype).

    A branch rather than two masked stores: the fp32 store may need its own register layout, and
    the branch not taken costs nothing."""
    base = tl.load(table + 4 * S + n)
    off = row * D
    if tl.load(table + 3 * S + n) == 0:
        tl.store(_ptr(base, tl.float32, ALIGN) + off + cols, x, mask=mask)
    else:
        tl.store(_ptr(base, tl.bfloat16, ALIGN) + off + cols, x.to(tl.bfloat16), mask=mask)


@triton.jit
def _row_tile(u_ptr, H, DH, BH: tl.constexpr, BDH: tl.constexpr):
    """The [heads, head size] tile of one row: head index, mask, column offsets and the folded query."""
    h = tl.arange(0, BH)
    j = tl.arange(0, BDH)
    mask = (h < H)[:, None] & (j < DH)[None, :]
    cols = h[:, None] * DH + j[None, :]
    return h, mask, cols, tl.load(u_ptr + cols, mask=mask, other=0.0)


@triton.jit
def _forward_kernel(
    table, S, u_ptr, out_ptr, lse_ptr, M1, D, H, DH, eps, BH: tl.constexpr, BDH: tl.constexpr, ALIGN: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    i0 = row // M1
    i1 = row % M1
    h, mask, cols, u = _row_tile(u_ptr, H, DH, BH, BDH)
    m = tl.full([BH], float("-inf"), tl.float32)
    z_sum = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, BDH], tl.float32)
    a32, a16 = _issue(table, S, 0, True, i0, i1, cols, mask, ALIGN)
    b32, b16 = _issue(table, S, 1 % S, 1 < S, i0, i1, cols, mask, ALIGN)
    for n in range(S):
        c32, c16 = _issue(table, S, (n + 2) % S, n + 2 < S, i0, i1, cols, mask, ALIGN)
        x = a32 + a16.to(tl.float32)  # two sources in flight
        r = tl.rsqrt(tl.sum(x * x) / D + eps)
        z = r * tl.sum(x * u, axis=1)
        m_new = tl.maximum(m, z)
        alpha = tl.exp(m - m_new)
        e = tl.exp(z - m_new)
        acc = acc * alpha[:, None] + e[:, None] * x
        z_sum = z_sum * alpha + e
        m = m_new
        a32, a16, b32, b16 = b32, b16, c32, c16
    out = acc / z_sum[:, None]
    tl.store(out_ptr + row * D + cols, out.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + row * H + h, m + tl.log(z_sum), mask=h < H)


@triton.jit
def _backward_stats_kernel(
    table, S, u_ptr, gout_ptr, lse_ptr, z_ptr, s_ptr, r_ptr, delta_ptr, M1, D, H, DH, eps,
    BH: tl.constexpr, BDH: tl.constexpr, ALIGN: tl.constexpr,
):  # fmt: skip
    """Per row (one program each, like the forward): for every source the RMS factor r[n], the logits
    z[n, h] and s[n, h] = <go[h], v_n[h]>, and delta[h] = sum_n p[n, h] s[n, h] = <go[h], mix[h]>
    (exact, without reading a rounded mix)."""
    row = tl.program_id(0).to(tl.int64)
    i0 = row // M1
    i1 = row % M1
    h, mask, cols, u = _row_tile(u_ptr, H, DH, BH, BDH)
    go = tl.load(gout_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + row * H + h, mask=h < H, other=0.0)
    delta = tl.zeros([BH], tl.float32)
    a32, a16 = _issue(table, S, 0, True, i0, i1, cols, mask, ALIGN)
    b32, b16 = _issue(table, S, 1 % S, 1 < S, i0, i1, cols, mask, ALIGN)
    for n in range(S):
        c32, c16 = _issue(table, S, (n + 2) % S, n + 2 < S, i0, i1, cols, mask, ALIGN)
        x = a32 + a16.to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x) / D + eps)
        z = r * tl.sum(x * u, axis=1)
        s = tl.sum(go * x, axis=1)
        delta += tl.exp(z - lse) * s
        tl.store(z_ptr + (row * S + n) * H + h, z, mask=h < H)
        tl.store(s_ptr + (row * S + n) * H + h, s, mask=h < H)
        tl.store(r_ptr + row * S + n, r)
        a32, a16, b32, b16 = b32, b16, c32, c16
    tl.store(delta_ptr + row * H + h, delta, mask=h < H)


@triton.jit
def _backward_coef_kernel(
    S, lse_ptr, z_ptr, s_ptr, r_ptr, delta_ptr, p_ptr, q_ptr, c_ptr, MS, D, H,
    BLOCK: tl.constexpr, BH: tl.constexpr,
):  # fmt: skip
    """Per (row, source) pair: p = softmax weight, q = r dz with dz = p (s - delta), c = -r^2 / D sum_h dz z."""
    pair = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    hh = tl.arange(0, BH)[None, :]
    ok = pair < MS
    mask = ok[:, None] & (hh < H)
    at = pair[:, None] * H + hh
    stat = (pair // S)[:, None] * H + hh
    z = tl.load(z_ptr + at, mask=mask, other=0.0)
    p = tl.exp(z - tl.load(lse_ptr + stat, mask=mask, other=0.0))
    dz = p * (tl.load(s_ptr + at, mask=mask, other=0.0) - tl.load(delta_ptr + stat, mask=mask, other=0.0))
    r = tl.load(r_ptr + pair, mask=ok, other=0.0)
    tl.store(p_ptr + at, p, mask=mask)
    tl.store(q_ptr + at, r[:, None] * dz, mask=mask)
    tl.store(c_ptr + pair, -r * r / D * tl.sum(tl.where(mask, dz * z, 0.0), axis=1), mask=ok)


@triton.jit
def _backward_apply_kernel(
    table, S, u_ptr, gout_ptr, p_ptr, q_ptr, c_ptr, du_ptr, M, M1, D, H, DH,
    BR: tl.constexpr, BH: tl.constexpr, BDH: tl.constexpr, ALIGN: tl.constexpr,
):  # fmt: skip
    """dv_n = p[n, h] go + q[n, h] u + c[n] v_n for BR rows of source n, and their partial sum of
    du = sum over rows of q[n, h] v_n (reduced over row blocks by the caller).

    Rows are [heads, head size] tiles as in the forward, so the per-head coefficients broadcast
    without gathers and addresses are computed once per 16-byte vector.
    """
    n = tl.program_id(0) % S
    first = (tl.program_id(0) // S).to(tl.int64) * BR
    h, mask, cols, u = _row_tile(u_ptr, H, DH, BH, BDH)
    du = tl.zeros([BH, BDH], tl.float32)
    for i in range(tl.minimum(M - first, BR)):
        row = first + i
        at = (row * S + n) * H + h
        p = tl.load(p_ptr + at, mask=h < H, other=0.0)[:, None]
        q = tl.load(q_ptr + at, mask=h < H, other=0.0)[:, None]
        c = tl.load(c_ptr + row * S + n)
        go = tl.load(gout_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        x32, x16 = _issue(table, S, n, True, row // M1, row % M1, cols, mask, ALIGN)
        x = x32 + x16.to(tl.float32)
        _store(table, S, n, row, D, cols, mask, p * go + q * u + c * x, ALIGN)
        du += q * x
    tl.store(du_ptr + tl.program_id(0).to(tl.int64) * D + cols, du, mask=mask)


ROW_ELEMS_PER_THREAD = 8  # row-tile elements per thread (sets the warps); RESULTS.md compares 8 and 16
APPLY_ROWS = 32  # rows per program of the elementwise backward pass (its du partial sums: rows / 32 x S x d)


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


def _table(
    sources: Sequence[Tensor], lead: torch.Size, grads: Sequence[Tensor] = ()
) -> tuple[Tensor, list[Tensor], bool]:
    """The int64 [5, S] table (address, stride0, stride1, dtype tag, gradient address) of the sources.

    Returns it with the views it points into (kept alive until launch) and whether every address and
    row offset is 16-byte aligned. The table goes to the GPU from pinned memory without a sync.
    """
    views, rows = [], [[], [], [], [], []]
    for n, v in enumerate(sources):
        v2, s0, s1 = _rows(v, lead)
        views.append(v2)
        for k, val in enumerate((v2.data_ptr(), s0, s1, _TAGS[v2.dtype], grads[n].data_ptr() if grads else 0)):
            rows[k].append(val)
    aligned = (
        views[0].shape[-1] % 8 == 0
        and all(a % 16 == 0 for a in rows[0] + rows[4])
        and all(s % 8 == 0 for s in rows[1] + rows[2])
    )
    device = sources[0].device
    table = torch.tensor(rows, dtype=torch.int64, pin_memory=device.type == "cuda")
    return table.to(device, non_blocking=True), views, aligned


def _launch_shape(d: int, heads: int, elems_per_thread: int) -> tuple[int, int, int]:
    """Tile [heads, head size] padded to powers of two, and warps giving `elems_per_thread` per tile."""
    bh = triton.next_power_of_2(heads)
    bdh = triton.next_power_of_2(d // heads)
    warps = 1 if _interpreted() else min(16, max(4, bh * bdh // (32 * elems_per_thread)))
    return bh, bdh, warps


def out_dtype(sources: Sequence[Tensor]) -> torch.dtype:
    """The output dtype of a route: bf16 when every source is bf16, fp32 otherwise."""
    return torch.bfloat16 if all(v.dtype == torch.bfloat16 for v in sources) else torch.float32


def route_forward(
    sources: Sequence[Tensor], u: Tensor, heads: int, eps: float, out: Tensor | None = None, lse: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Forward route with the folded query `u = query * norm_weight` (fp32, [d]).

    Returns the mix [..., d] (bf16 if all sources are bf16, else fp32) and the per-head
    log-sum-exp [..., heads] in fp32. `out` / `lse` may be given as destination buffers.
    """
    lead, d = sources[0].shape[:-1], sources[0].shape[-1]
    table, views, aligned = _table(sources, lead)
    rows = lead.numel()
    if out is None:
        out = torch.empty(*lead, d, dtype=out_dtype(sources), device=u.device)
    if lse is None:
        lse = torch.empty(*lead, heads, dtype=torch.float32, device=u.device)
    bh, bdh, warps = _launch_shape(d, heads, ROW_ELEMS_PER_THREAD)
    if rows:
        _forward_kernel[(rows,)](
            table,
            len(sources),
            u.contiguous(),
            out,
            lse,
            views[0].shape[1],
            d,
            heads,
            d // heads,
            eps,
            BH=bh,
            BDH=bdh,
            ALIGN=aligned and (d // heads) % 8 == 0,
            num_warps=warps,
        )
    return out, lse


def route_backward(
    grad_out: Tensor,
    lse: Tensor,
    sources: Sequence[Tensor],
    u: Tensor,
    heads: int,
    eps: float,
    grads: Sequence[Tensor] | None = None,
) -> tuple[list[Tensor], Tensor]:
    """Gradients of the route: one per source (its dtype, contiguous) and du = dL/d(query * norm_weight).

    Three kernels: per-row statistics (one program per row, reading every source once), the
    coefficients p, q, c per (row, source), then one program per (block of rows, source) writing that
    source's gradient. `du` is reduced over tokens deterministically: partial sums per program of the
    last kernel, then one `sum` over them.
    """
    lead, d = sources[0].shape[:-1], sources[0].shape[-1]
    if grads is None:
        dtypes = [v.dtype if v.dtype in _TAGS else torch.float32 for v in sources]
        grads = [torch.empty(*lead, d, dtype=dt, device=u.device) for dt in dtypes]
    rows, S, dh = lead.numel(), len(sources), d // heads
    if rows == 0:
        return list(grads), torch.zeros(d, dtype=torch.float32, device=u.device)
    table, views, aligned = _table(sources, lead, grads)
    align = aligned and dh % 8 == 0
    grad_out, lse, u = grad_out.contiguous(), lse.contiguous(), u.contiguous()
    z = torch.empty(rows, S, heads, dtype=torch.float32, device=u.device)
    s = torch.empty_like(z)
    r = torch.empty(rows, S, dtype=torch.float32, device=u.device)
    delta = torch.empty(rows, heads, dtype=torch.float32, device=u.device)
    bh, bdh, warps = _launch_shape(d, heads, ROW_ELEMS_PER_THREAD)
    _backward_stats_kernel[(rows,)](
        table, S, u, grad_out, lse, z, s, r, delta, views[0].shape[1], d, heads, dh, eps,
        BH=bh, BDH=bdh, ALIGN=align, num_warps=warps,
    )  # fmt: skip
    p, q, c = torch.empty_like(z), torch.empty_like(z), torch.empty_like(r)
    block = 64
    _backward_coef_kernel[(triton.cdiv(rows * S, block),)](
        S, lse, z, s, r, delta, p, q, c, rows * S, d, heads, BLOCK=block, BH=bh, num_warps=1 if _interpreted() else 4
    )
    blocks = triton.cdiv(rows, APPLY_ROWS) * S
    du = torch.empty(blocks, d, dtype=torch.float32, device=u.device)
    _backward_apply_kernel[(blocks,)](
        table, S, u, grad_out, p, q, c, du, rows, views[0].shape[1], d, heads, dh,
        BR=APPLY_ROWS, BH=bh, BDH=bdh, ALIGN=align, num_warps=warps,
    )  # fmt: skip
    return list(grads), du.sum(0)
