"""The routing backward kernels: per-row coefficients, then each source's gradient.

In the package docstring's notation, with upstream gradients go_k of query k's mix and gl_k of its log-sum-exp:

    p_{n,k,h}  = exp(z_{n,k,h} - lse_{k,h})                  renormalised to sum to 1 over n
    s_{n,k,h}  = <go_k[h], v_n[h]>;   delta_{k,h} = sum_n p s = <go_k[h], out_k[h]>
    dz_{n,k,h} = p (s - delta + gl_{k,h})
    dv_n       = sum_k (p_{n,k,.} go_k + r_n dz_{n,k,.} u_k) - (r_n^2 / d) (sum_{k,h} dz z) v_n
    du_k       = sum over rows and n of r_n dz_{n,k,.} v_n

The statistics kernel runs one program per row over every source and leaves per (row, source) p, q = r dz and
c = -(r^2 / d) sum dz z; the gradient kernel then runs one program per (block of rows, source), writes that source's
gradient and its block's partial sum of du (reduced by the caller, so without atomics).
"""

import triton
import triton.language as tl
from mhar_lightning.kernels.forward_kernel import MASKED_LOGIT
from mhar_lightning.kernels.rows import issue_row, query_tiles, row_tile, row_value, store_grad_row


@triton.jit
def _stats_step(x, r, u, go, lse, delta, total, live):
    """One query's logits z and sums s = <go, x> per head for source row x of inverse RMS r; p s added to delta and
    p to total."""
    z = tl.where(live, r * tl.sum(x * u, axis=1), MASKED_LOGIT)
    s = tl.sum(go * x, axis=1)
    p = tl.exp(z - lse)
    return z, s, delta + p * s, total + p


@triton.jit
def _put_zs(zs, k, col, z, s, Q: tl.constexpr):
    """zs ([heads, 4 Q]) with one query's z in column col and its s in column col + Q."""
    return tl.where(k == col, z[:, None], tl.where(k == col + Q, s[:, None], zs))


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
    """Per row (one program each, like the forward), p[n, k, h], q[n, k, h] and c[n] of every source n and query k
    (the module docstring), with gl = 0 unless HAS_GLSE, and r[n] the inverse RMS the forward saved. p is
    renormalised to sum to 1: a sharp softmax's gradient is otherwise swamped by the rounding of the forward's lse
    and r. The loop over sources leaves z and s in the p and q buffers, two sources to a store: per-head values are
    stored through shared memory, two barriers a store, and a store per pair made the kernel 10-12 % faster at 25-49
    sources on an H200. Once delta is complete, a second loop turns them into p, q and c, SC sources at a time.
    """
    row = tl.program_id(0).to(tl.int64)
    i0 = row // M1
    i1 = row % M1
    h, hmask, mask, cols = row_tile(H, DH, BH, BDH)
    u0, u1 = query_tiles(u_ptr, D, cols, mask, Q)
    rms = rms_ptr + row * S
    x32, x16 = issue_row(table, 0, True, i0, i1, cols, mask, K0, ALIGN)
    a32, a16 = issue_row(table, 1 % S, 1 < S, i0, i1, cols, mask, KR, ALIGN)
    b32, b16 = issue_row(table, 2 % S, 2 < S, i0, i1, cols, mask, KR, ALIGN)
    rx, ra, rb = tl.load(rms), tl.load(rms + 1 % S), tl.load(rms + 2 % S)
    go0 = tl.load(gout_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    lse0 = tl.load(lse_ptr + row * H + h, mask=hmask, other=0.0)
    go1, lse1 = go0, lse0
    if Q == 2:
        go1 = tl.load(gout_ptr + (G1R + row) * D + G1E + cols, mask=mask, other=0.0).to(tl.float32)
        lse1 = tl.load(lse_ptr + (M + row) * H + h, mask=hmask, other=0.0)
    delta0 = tl.zeros([BH], tl.float32)
    delta1, total0, total1 = delta0, delta0, delta0
    # zs holds two sources' z and s, per query: columns [z_0 .. z_Q-1, s_0 .. s_Q-1] of one source, then the other's
    k = tl.arange(0, 4 * Q)[None, :]
    x = row_value(x32, x16, K0)
    y0, t0, delta0, total0 = _stats_step(x, rx, u0, go0, lse0, delta0, total0, True)
    if Q == 2:
        y1, t1, delta1, total1 = _stats_step(x, rx, u1, go1, lse1, delta1, total1, True)
    zs = _put_zs(tl.zeros([BH, 4 * Q], tl.float32), k, 0, y0, t0, Q)
    if Q == 2:
        zs = _put_zs(zs, k, 1, y1, t1, Q)
    slot = row * S * 2 * Q * H + (k % (2 * Q)) * H + h[:, None]  # source 0's slot: columns k < 2Q
    tl.store(p_ptr + slot, zs, mask=hmask[:, None] & (k < 2 * Q))
    for n in range(1, S, 2):  # sources n and n + 1 (when n + 1 < S) leave in one store
        c32, c16 = issue_row(table, tl.minimum(n + 2, S - 1), n + 2 < S, i0, i1, cols, mask, KR, ALIGN)
        d32, d16 = issue_row(table, tl.minimum(n + 3, S - 1), n + 3 < S, i0, i1, cols, mask, KR, ALIGN)
        rc, rd = tl.load(rms + tl.minimum(n + 2, S - 1)), tl.load(rms + tl.minimum(n + 3, S - 1))
        x = row_value(a32, a16, KR)
        y0, t0, delta0, total0 = _stats_step(x, ra, u0, go0, lse0, delta0, total0, n < S0)
        if Q == 2:
            y1, t1, delta1, total1 = _stats_step(x, ra, u1, go1, lse1, delta1, total1, n < S1)
        zs = _put_zs(zs, k, 0, y0, t0, Q)
        if Q == 2:
            zs = _put_zs(zs, k, 1, y1, t1, Q)
        x = row_value(b32, b16, KR)
        y0, t0, delta0, total0 = _stats_step(x, rb, u0, go0, lse0, delta0, total0, n + 1 < S0)
        if Q == 2:
            y1, t1, delta1, total1 = _stats_step(x, rb, u1, go1, lse1, delta1, total1, n + 1 < S1)
        zs = _put_zs(zs, k, 2 * Q, y0, t0, Q)
        if Q == 2:
            zs = _put_zs(zs, k, 2 * Q + 1, y1, t1, Q)
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
    table, S, n, first, count, u0, u1, h, hmask, mask, cols, gout_ptr, G1R, G1E, p_ptr, q_ptr, c_ptr, M1, D, H,
    KIND: tl.constexpr, ALIGN: tl.constexpr, Q: tl.constexpr,
):  # fmt: skip
    """Write dv_n for rows first.. first + count - 1 of source n (of kind KIND); return their sums of q v_n,
    one per query. Query 1's gradient row is at gout_ptr + (G1R + row) * D + G1E (see `_gradient_offsets`)."""
    du0 = tl.zeros_like(u0)
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
        x32, x16 = issue_row(table, n, True, row // M1, row % M1, cols, mask, KIND, ALIGN)
        x = row_value(x32, x16, KIND)
        store_grad_row(table, n, row, D, cols, mask, g + c * x, ALIGN)
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
    sums of du_k = sum over rows of q[n, k, h] v_n (reduced over row blocks by the caller)."""
    n = tl.program_id(0) % S
    first = (tl.program_id(0) // S).to(tl.int64) * BR
    count = tl.minimum(M - first, BR)
    h, hmask, mask, cols = row_tile(H, DH, BH, BDH)
    u0, u1 = query_tiles(u_ptr, D, cols, mask, Q)
    rows = table, S, n, first, count, u0, u1, h, hmask, mask, cols, gout_ptr, G1R, G1E, p_ptr, q_ptr, c_ptr, M1, D, H
    if n == 0:  # uniform per program: source 0 loads with its own kind
        du0, du1 = _apply_rows(*rows, K0, ALIGN, Q)
    else:
        du0, du1 = _apply_rows(*rows, KR, ALIGN, Q)
    at = tl.program_id(0).to(tl.int64) * Q * D + cols
    tl.store(du_ptr + at, du0, mask=mask)
    if Q == 2:
        tl.store(du_ptr + at + D, du1, mask=mask)
