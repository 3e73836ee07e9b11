"""Fused Triton kernels for depth routing (forward and backward) and their launchers.

Sources reach the kernels through a pointer table (address, two leading strides and a dtype tag
per source), so the history is never concatenated and each call reads every source once.
One program handles whole rows (tokens); the heads of a row are a [BH, BDH] register tile, so
the full-width RMS that couples the heads is a plain reduction over the tile.
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
    """Store an fp32 row into the gradient buffer of source n (contiguous, the source's dtype)."""
    base = tl.load(table + 4 * S + n)
    tag = tl.load(table + 3 * S + n)
    off = row * D
    tl.store(_ptr(base, tl.float32, ALIGN) + off + cols, x, mask=tl.where(tag == 0, mask, False))
    tl.store(_ptr(base, tl.bfloat16, ALIGN) + off + cols, x.to(tl.bfloat16), mask=tl.where(tag == 1, mask, False))


@triton.jit
def _forward_kernel(
    table, S, u_ptr, out_ptr, lse_ptr, M1, D, H, DH, eps, BH: tl.constexpr, BDH: tl.constexpr, ALIGN: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    i0 = row // M1
    i1 = row % M1
    h = tl.arange(0, BH)
    j = tl.arange(0, BDH)
    mask = (h < H)[:, None] & (j < DH)[None, :]
    cols = h[:, None] * DH + j[None, :]
    u = tl.load(u_ptr + cols, mask=mask, other=0.0)
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
def _backward_kernel(
    table,
    S,
    u_ptr,
    out_ptr,
    gout_ptr,
    lse_ptr,
    du_ptr,
    M,
    M1,
    D,
    H,
    DH,
    eps,
    BH: tl.constexpr,
    BDH: tl.constexpr,
    ALIGN: tl.constexpr,
    EXACT_DELTA: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.arange(0, BH)
    j = tl.arange(0, BDH)
    mask = (h < H)[:, None] & (j < DH)[None, :]
    cols = h[:, None] * DH + j[None, :]
    u = tl.load(u_ptr + cols, mask=mask, other=0.0)
    du = tl.zeros([BH, BDH], tl.float32)
    for row in range(pid.to(tl.int64), M, tl.num_programs(0)):
        i0 = row // M1
        i1 = row % M1
        go = tl.load(gout_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        lse = tl.load(lse_ptr + row * H + h, mask=h < H, other=0.0)
        if EXACT_DELTA:  # delta = sum_n p_n <go, v_n>: one more pass over the sources, no rounded mix
            delta = tl.zeros([BH], tl.float32)
            for n in range(S):
                a32, a16 = _issue(table, S, n, True, i0, i1, cols, mask, ALIGN)
                x = a32 + a16.to(tl.float32)
                z = tl.rsqrt(tl.sum(x * x) / D + eps) * tl.sum(x * u, axis=1)
                delta += tl.exp(z - lse) * tl.sum(go * x, axis=1)
        else:  # delta = <go, mix> from the saved fp32 mix
            delta = tl.sum(go * tl.load(out_ptr + row * D + cols, mask=mask, other=0.0), axis=1)
        a32, a16 = _issue(table, S, 0, True, i0, i1, cols, mask, ALIGN)
        b32, b16 = _issue(table, S, 1 % S, 1 < S, i0, i1, cols, mask, ALIGN)
        for n in range(S):
            c32, c16 = _issue(table, S, (n + 2) % S, n + 2 < S, i0, i1, cols, mask, ALIGN)
            x = a32 + a16.to(tl.float32)
            r = tl.rsqrt(tl.sum(x * x) / D + eps)
            z = r * tl.sum(x * u, axis=1)
            p = tl.exp(z - lse)
            dz = p * (tl.sum(go * x, axis=1) - delta)
            c = -r * r / D * tl.sum(dz * z)
            dv = p[:, None] * go + (r * dz)[:, None] * u + c * x
            _store(table, S, n, row, D, cols, mask, dv, ALIGN)
            du += (dz * r)[:, None] * x
            a32, a16, b32, b16 = b32, b16, c32, c16
    tl.store(du_ptr + pid * D + cols, du, mask=mask)


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
    bh, bdh, warps = _launch_shape(d, heads, 8)  # one 16-byte vector of bf16 per thread
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
    out: Tensor,
    lse: Tensor,
    sources: Sequence[Tensor],
    u: Tensor,
    heads: int,
    eps: float,
    grads: Sequence[Tensor] | None = None,
) -> tuple[list[Tensor], Tensor]:
    """Gradients of the route: one per source (its dtype, contiguous) and du = dL/d(query * norm_weight).

    `du` is reduced over tokens in two deterministic stages: per-program partial sums written by
    the kernel, then one `sum` over programs.
    """
    lead, d = sources[0].shape[:-1], sources[0].shape[-1]
    if grads is None:
        dtypes = [v.dtype if v.dtype in _TAGS else torch.float32 for v in sources]
        grads = [torch.empty(*lead, d, dtype=dt, device=u.device) for dt in dtypes]
    table, views, aligned = _table(sources, lead, grads)
    rows = lead.numel()
    if _interpreted() or u.device.type != "cuda":
        programs = min(rows, 4)
    else:
        programs = min(rows, 4 * torch.cuda.get_device_properties(u.device).multi_processor_count)
    programs = max(programs, 1)
    du = torch.empty(programs, d, dtype=torch.float32, device=u.device)
    bh, bdh, warps = _launch_shape(d, heads, 4)  # more live tiles: halve the registers per thread
    _backward_kernel[(programs,)](
        table,
        len(sources),
        u.contiguous(),
        out.contiguous(),
        grad_out.contiguous(),
        lse.contiguous(),
        du,
        rows,
        views[0].shape[1],
        d,
        heads,
        d // heads,
        eps,
        BH=bh,
        BDH=bdh,
        ALIGN=aligned and (d // heads) % 8 == 0,
        EXACT_DELTA=out.dtype != torch.float32,
        num_warps=warps,
    )
    return list(grads), du.sum(0)
