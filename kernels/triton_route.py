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
from mhar_lightning.kernels.reference import check_counts
from torch import Tensor

_TAGS = {torch.float32: 0, torch.bfloat16: 1}  # dtype tag per source in the table (the kernels test 0 / 1)
MASKED_LOGIT = tl.constexpr(-1.0e30)  # logit of a source a query does not read: weight 0, and 0 * it stays finite
RESCALE_MARGIN = tl.constexpr(8.0)  # the forward rescales its mix only when a logit exceeds the reference max by this


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
def _row_tile(u_ptr, H, DH, D, BH: tl.constexpr, BDH: tl.constexpr, Q: tl.constexpr):
    """The [heads, head size] tile of one row (head index, mask, column offsets) and the folded queries u0, u1
    (u1 is u0 when Q = 1). Two queries are two tiles in the row's layout: a [queries, heads, head size]
    tile lays the query axis across warps and measured up to 8x slower per kernel on an H200."""
    h = tl.arange(0, BH)
    j = tl.arange(0, BDH)
    mask = (h < H)[:, None] & (j < DH)[None, :]
    cols = h[:, None] * DH + j[None, :]
    u0 = tl.load(u_ptr + cols, mask=mask, other=0.0)
    u1 = u0
    if Q == 2:
        u1 = tl.load(u_ptr + D + cols, mask=mask, other=0.0)
    return h, mask, cols, u0, u1


@triton.jit
def _mix_step(x, r, u, m, z_sum, acc, live, LAZY: tl.constexpr):
    """Online-softmax update of one query's per-head reference max, normaliser and mix with one more source
    row x of inverse RMS r (weight 0 unless `live`: the query reads fewer sources). LAZY moves the reference only
    when a logit exceeds it by RESCALE_MARGIN, so most sources skip rescaling the mix: exact either way (the
    weights are exp(z - m) / z_sum for any m), but deciding it takes a max over heads, which crosses warps
    unless the row fits in one."""
    z = tl.where(live, r * tl.sum(x * u, axis=1), MASKED_LOGIT)
    if LAZY:
        if tl.max(z - m, axis=0) > RESCALE_MARGIN:
            m_new = tl.maximum(m, z)
            alpha = tl.exp(m - m_new)
            z_sum, acc, m = z_sum * alpha, acc * alpha[:, None], m_new
        e = tl.exp(z - m)
        return m, z_sum + e, acc + e[:, None] * x
    m_new = tl.maximum(m, z)
    alpha = tl.exp(m - m_new)
    e = tl.exp(z - m_new)
    return m_new, z_sum * alpha + e, acc * alpha[:, None] + e[:, None] * x


@triton.jit
def _mix_both(x, u0, u1, m0, z0, acc0, m1, z1, acc1, r_ptr, D, eps, live0, live1, Q: tl.constexpr, LAZY: tl.constexpr):
    """`_mix_step` for each query (the RMS is shared, and stored at `r_ptr` for the backward)."""
    r = tl.rsqrt(tl.sum(x * x) / D + eps)
    tl.store(r_ptr, r)
    m0, z0, acc0 = _mix_step(x, r, u0, m0, z0, acc0, live0, LAZY)
    if Q == 2:
        m1, z1, acc1 = _mix_step(x, r, u1, m1, z1, acc1, live1, LAZY)
    return m0, z0, acc0, m1, z1, acc1


@triton.jit
def _forward_kernel(
    table, S, S0, S1, u_ptr, out0_ptr, out1_ptr, lse_ptr, rms_ptr, M, M1, D, H, DH, eps,
    BH: tl.constexpr, BDH: tl.constexpr, K0: tl.constexpr, KR: tl.constexpr, ALIGN: tl.constexpr, Q: tl.constexpr,
    LAZY: tl.constexpr,
):  # fmt: skip
    """One row per program, every query at once: source 0 (kind K0), then sources 1.. (kind KR) with two
    loads in flight. Query k reads sources 0 .. Sk - 1 and writes its mix at outk_ptr. Each source's inverse RMS goes
    to rms [rows, S]."""
    row = tl.program_id(0).to(tl.int64)
    i0 = row // M1
    i1 = row % M1
    h, mask, cols, u0, u1 = _row_tile(u_ptr, H, DH, D, BH, BDH, Q)
    x32, x16 = _issue(table, 0, True, i0, i1, cols, mask, K0, ALIGN)
    a32, a16 = _issue(table, 1 % S, 1 < S, i0, i1, cols, mask, KR, ALIGN)
    b32, b16 = _issue(table, 2 % S, 2 < S, i0, i1, cols, mask, KR, ALIGN)
    m0, z0 = tl.full([BH], float("-inf"), tl.float32), tl.zeros([BH], tl.float32)
    acc0 = tl.zeros([BH, BDH], tl.float32)
    m1, z1, acc1 = m0, z0, acc0
    m0, z0, acc0, m1, z1, acc1 = _mix_both(
        _value(x32, x16, K0), u0, u1, m0, z0, acc0, m1, z1, acc1, rms_ptr + row * S, D, eps, True, True, Q, LAZY
    )
    for n in range(1, S):
        c32, c16 = _issue(table, tl.minimum(n + 2, S - 1), n + 2 < S, i0, i1, cols, mask, KR, ALIGN)
        x = _value(a32, a16, KR)
        m0, z0, acc0, m1, z1, acc1 = _mix_both(
            x, u0, u1, m0, z0, acc0, m1, z1, acc1, rms_ptr + row * S + n, D, eps, n < S0, n < S1, Q, LAZY
        )
        a32, a16, b32, b16 = b32, b16, c32, c16
    tl.store(out0_ptr + row * D + cols, (acc0 / z0[:, None]).to(out0_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + row * H + h, m0 + tl.log(z0), mask=h < H)
    if Q == 2:
        tl.store(out1_ptr + row * D + cols, (acc1 / z1[:, None]).to(out1_ptr.dtype.element_ty), mask=mask)
        tl.store(lse_ptr + (M + row) * H + h, m1 + tl.log(z1), mask=h < H)


@triton.jit
def _stats_step(x, r, u, go, lse, delta, total, live):
    """One query's logits z and sums s = <go, x> per head for source row x; p s added to delta and p to total."""
    z = tl.where(live, r * tl.sum(x * u, axis=1), MASKED_LOGIT)
    s = tl.sum(go * x, axis=1)
    p = tl.exp(z - lse)
    return z, s, delta + p * s, total + p


@triton.jit
def _stats_values(x, r, u0, u1, go0, go1, lse0, lse1, delta0, delta1, total0, total1, live0, live1, Q: tl.constexpr):
    """`_stats_step` for each query (z1 and s1 repeat z0 and s0 when Q = 1), for source row x of inverse RMS r."""
    z0, s0, delta0, total0 = _stats_step(x, r, u0, go0, lse0, delta0, total0, live0)
    z1, s1 = z0, s0
    if Q == 2:
        z1, s1, delta1, total1 = _stats_step(x, r, u1, go1, lse1, delta1, total1, live1)
    return z0, s0, z1, s1, delta0, delta1, total0, total1


@triton.jit
def _zs_tile(k, zs, first, z0, s0, z1, s1, Q: tl.constexpr):
    """Tile zs ([heads, 4 Q]) with one source's z and s of each query in columns first .. first + 2 Q - 1, in the
    order of the source's slot in the p and q buffers (z of each query, then s of each)."""
    zs = tl.where(k == first, z0[:, None], tl.where(k == first + Q, s0[:, None], zs))
    if Q == 2:
        zs = tl.where(k == first + 1, z1[:, None], tl.where(k == first + 3, s1[:, None], zs))
    return zs


@triton.jit
def _coefficients(p_ptr, q_ptr, at, hmask, lse, scale, delta):
    """One query's softmax weights p = exp(z - lse) scale and dz = p (s - delta) from the z and s stored at `at`."""
    z = tl.load(p_ptr + at, mask=hmask, other=0.0)
    p = tl.exp(z - lse) * scale
    return z, p, p * (tl.load(q_ptr + at, mask=hmask, other=0.0) - delta)


@triton.jit
def _backward_stats_kernel(
    table, S, S0, S1, u_ptr, gout_ptr, G1R, G1E, glse_ptr, lse_ptr, rms_ptr, p_ptr, q_ptr, c_ptr, M, M1, D, H, DH,
    BH: tl.constexpr, BDH: tl.constexpr, K0: tl.constexpr, KR: tl.constexpr, ALIGN: tl.constexpr,
    HAS_GLSE: tl.constexpr, Q: tl.constexpr, SC: tl.constexpr,
):  # fmt: skip
    """Per row (one program each, like the forward), the coefficients of every source's gradient, per query k:
    p[n, k, h] (softmax weight), q[n, k, h] = r[n] dz[n, k, h] and c[n] = -r[n]^2 / D sum_k,h dz z, where
    dz = p (s - delta + g), s[n, k, h] = <go_k[h], v_n[h]>, delta[k, h] = sum_n p s = <go_k[h], mix_k[h]>
    (exact, without reading a rounded mix) and g[k, h] the upstream gradient of the log-sum-exp (HAS_GLSE;
    else 0), with r[n] the inverse RMS the forward saved. p = exp(z - lse) is renormalised to sum to 1: a sharp
    softmax's gradient is otherwise swamped by the rounding of the forward's lse and r. The loop over sources
    leaves z and s in the p and q buffers, two sources to a store: per-head values are stored through shared memory,
    two barriers a store, and a store per pair made the kernel 10-12 % faster at 25-49 sources on an H200. Once
    delta is complete, a second loop turns them into p, q and c, SC sources at a time.
    """
    row = tl.program_id(0).to(tl.int64)
    i0 = row // M1
    i1 = row % M1
    h, mask, cols, u0, u1 = _row_tile(u_ptr, H, DH, D, BH, BDH, Q)
    rms = rms_ptr + row * S
    x32, x16 = _issue(table, 0, True, i0, i1, cols, mask, K0, ALIGN)
    a32, a16 = _issue(table, 1 % S, 1 < S, i0, i1, cols, mask, KR, ALIGN)
    b32, b16 = _issue(table, 2 % S, 2 < S, i0, i1, cols, mask, KR, ALIGN)
    rx, ra, rb = tl.load(rms), tl.load(rms + 1 % S), tl.load(rms + 2 % S)
    hmask = h < H
    go0 = tl.load(gout_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    lse0 = tl.load(lse_ptr + row * H + h, mask=hmask, other=0.0)
    go1, lse1 = go0, lse0
    if Q == 2:
        go1 = tl.load(gout_ptr + (G1R + row) * D + G1E + cols, mask=mask, other=0.0).to(tl.float32)
        lse1 = tl.load(lse_ptr + (M + row) * H + h, mask=hmask, other=0.0)
    delta0 = tl.zeros([BH], tl.float32)
    delta1, total0, total1 = delta0, delta0, delta0
    k = tl.arange(0, 4 * Q)[None, :]  # y and t below are a source's z and s (the second loop's z0 and p0 are tiles)
    y0, t0, y1, t1, delta0, delta1, total0, total1 = _stats_values(
        _value(x32, x16, K0), rx, u0, u1, go0, go1, lse0, lse1, delta0, delta1, total0, total1, True, True, Q
    )
    zs = _zs_tile(k, tl.zeros([BH, 4 * Q], tl.float32), 0, y0, t0, y1, t1, Q)
    slot = row * S * 2 * Q * H + (k % (2 * Q)) * H + h[:, None]  # source 0's slot: columns k < 2Q
    tl.store(p_ptr + slot, zs, mask=hmask[:, None] & (k < 2 * Q))
    for n in range(1, S, 2):  # sources n and n + 1 (when n + 1 < S) leave in one store
        c32, c16 = _issue(table, tl.minimum(n + 2, S - 1), n + 2 < S, i0, i1, cols, mask, KR, ALIGN)
        d32, d16 = _issue(table, tl.minimum(n + 3, S - 1), n + 3 < S, i0, i1, cols, mask, KR, ALIGN)
        rc, rd = tl.load(rms + tl.minimum(n + 2, S - 1)), tl.load(rms + tl.minimum(n + 3, S - 1))
        y0, t0, y1, t1, delta0, delta1, total0, total1 = _stats_values(
            _value(a32, a16, KR), ra, u0, u1, go0, go1, lse0, lse1, delta0, delta1, total0, total1, n < S0, n < S1, Q
        )
        zs = _zs_tile(k, zs, 0, y0, t0, y1, t1, Q)
        y0, t0, y1, t1, delta0, delta1, total0, total1 = _stats_values(
            _value(b32, b16, KR), rb, u0, u1, go0, go1, lse0, lse1, delta0, delta1, total0, total1,
            n + 1 < S0, n + 1 < S1, Q,
        )  # fmt: skip
        zs = _zs_tile(k, zs, 2 * Q, y0, t0, y1, t1, Q)
        slot = (row * S + n) * 2 * Q * H + (k // (2 * Q)) * 2 * Q * H + (k % (2 * Q)) * H + h[:, None]  # n + k // 2Q's
        tl.store(p_ptr + slot, zs, mask=hmask[:, None] & (k < tl.where(n + 1 < S, 4 * Q, 2 * Q)))
        a32, a16, b32, b16, ra, rb = c32, c16, d32, d16, rc, rd
    scale0 = 1.0 / total0  # p renormalised to sum to 1, whatever the forward's rounding of lse and of r
    delta0 *= scale0
    scale1 = scale0
    if Q == 2:
        scale1 = 1.0 / total1
        delta1 *= scale1
    if HAS_GLSE:
        delta0 -= tl.load(glse_ptr + row * H + h, mask=hmask, other=0.0)
        if Q == 2:
            delta1 -= tl.load(glse_ptr + (M + row) * H + h, mask=hmask, other=0.0)
    tl.debug_barrier()  # the second loop reads values other threads of this program stored
    for first in range(0, S, SC):  # SC sources at once: a [sources, heads] tile per query
        ns = first + tl.arange(0, SC)
        nmask = ns < S
        smask = nmask[:, None] & hmask[None, :]
        at = (row * S + ns[:, None]) * 2 * Q * H + h[None, :]
        z0, p0, dz0 = _coefficients(p_ptr, q_ptr, at, smask, lse0[None, :], scale0[None, :], delta0[None, :])
        zdz = tl.sum(tl.where(smask, dz0 * z0, 0.0), axis=1)
        if Q == 2:
            z1, p1, dz1 = _coefficients(p_ptr, q_ptr, at + H, smask, lse1[None, :], scale1[None, :], delta1[None, :])
            zdz += tl.sum(tl.where(smask, dz1 * z1, 0.0), axis=1)
        r = tl.load(rms + ns, mask=nmask, other=0.0)
        tl.debug_barrier()  # every thread has read z and s before any overwrites them
        tl.store(p_ptr + at, p0, mask=smask)
        tl.store(q_ptr + at, r[:, None] * dz0, mask=smask)
        if Q == 2:
            tl.store(p_ptr + at + H, p1, mask=smask)
            tl.store(q_ptr + at + H, r[:, None] * dz1, mask=smask)
        tl.store(c_ptr + row * S + ns, -r * r / D * zdz, mask=nmask)


@triton.jit
def _apply_rows(
    table, S, n, first, count, u0, u1, h, mask, cols, gout_ptr, G1R, G1E, p_ptr, q_ptr, c_ptr, M, M1, D, H,
    BH: tl.constexpr, BDH: tl.constexpr, KIND: tl.constexpr, ALIGN: tl.constexpr, Q: tl.constexpr,
):  # fmt: skip
    """Write dv_n for rows first.. first + count - 1 of source n (of kind KIND); return their sums of q v_n,
    one per query. Query 1's gradient row is at gout_ptr + (G1R + row) * D + G1E (see `_gradient_offsets`)."""
    hmask = h < H
    du0 = tl.zeros([BH, BDH], tl.float32)
    du1 = du0
    for i in range(count):
        row = first + i
        at = (row * S + n) * 2 * Q * H + h
        q0 = tl.load(q_ptr + at, mask=hmask, other=0.0)[:, None]
        go0 = tl.load(gout_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(p_ptr + at, mask=hmask, other=0.0)[:, None] * go0 + q0 * u0
        if Q == 2:
            q1 = tl.load(q_ptr + at + H, mask=hmask, other=0.0)[:, None]
            go1 = tl.load(gout_ptr + (G1R + row) * D + G1E + cols, mask=mask, other=0.0).to(tl.float32)
            g += tl.load(p_ptr + at + H, mask=hmask, other=0.0)[:, None] * go1 + q1 * u1
        c = tl.load(c_ptr + row * S + n)
        x32, x16 = _issue(table, n, True, row // M1, row % M1, cols, mask, KIND, ALIGN)
        x = _value(x32, x16, KIND)
        _store(table, n, row, D, cols, mask, g + c * x, ALIGN)
        du0 += q0 * x
        if Q == 2:
            du1 += q1 * x
    return du0, du1


@triton.jit
def _backward_apply_kernel(
    table, S, u_ptr, gout_ptr, G1R, G1E, p_ptr, q_ptr, c_ptr, du_ptr, M, M1, D, H, DH, BR: tl.constexpr,
    BH: tl.constexpr, BDH: tl.constexpr, K0: tl.constexpr, KR: tl.constexpr, ALIGN: tl.constexpr, Q: tl.constexpr,
):  # fmt: skip
    """dv_n = sum_k (p[n, k, h] go_k + q[n, k, h] u_k) + c[n] v_n for BR rows of source n, and their partial
    sums of du_k = sum over rows of q[n, k, h] v_n (reduced over row blocks by the caller).

    Rows are [heads, head size] tiles as in the forward, so the per-head coefficients broadcast
    without gathers and addresses are computed once per 16-byte vector.
    """
    n = tl.program_id(0) % S
    first = (tl.program_id(0) // S).to(tl.int64) * BR
    count = tl.minimum(M - first, BR)
    h, mask, cols, u0, u1 = _row_tile(u_ptr, H, DH, D, BH, BDH, Q)
    if n == 0:  # uniform per program: each branch loads with its own kind
        du0, du1 = _apply_rows(
            table, S, n, first, count, u0, u1, h, mask, cols, gout_ptr, G1R, G1E, p_ptr, q_ptr, c_ptr, M, M1, D, H,
            BH, BDH, K0, ALIGN, Q,
        )  # fmt: skip
    else:
        du0, du1 = _apply_rows(
            table, S, n, first, count, u0, u1, h, mask, cols, gout_ptr, G1R, G1E, p_ptr, q_ptr, c_ptr, M, M1, D, H,
            BH, BDH, KR, ALIGN, Q,
        )  # fmt: skip
    at = tl.program_id(0).to(tl.int64) * Q * D + cols
    tl.store(du_ptr + at, du0, mask=mask)
    if Q == 2:
        tl.store(du_ptr + at + D, du1, mask=mask)


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
    table, views, aligned, k0, kr = _table(sources, lead)
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
        dtypes = [v.dtype if v.dtype in _TAGS else torch.float32 for v in sources]
        grads = [torch.empty(*lead, d, dtype=dt, device=u.device) for dt in dtypes]
    rows, S, dh = lead.numel(), len(sources), d // heads
    du = torch.empty(du_blocks(rows, S), n_queries, d, dtype=torch.float32, device=u.device)
    if rows == 0:
        return list(grads), du
    table, views, aligned, k0, kr = _table(sources, lead, grads)
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
