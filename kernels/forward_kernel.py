"""The routing forward kernel: one program per row, an online softmax over its sources for one or two queries.

What it computes is stated once, in the package docstring (`mhar_lightning.kernels`). Per query it keeps, per head,
a running reference max m, normaliser Z and mix acc, so each source row is read once; it also saves each source's
inverse RMS r_n for the backward, and writes per query the mix acc / Z and lse = m + log Z.
"""

import triton
import triton.language as tl
from mhar_lightning.kernels.rows import issue_row, query_tiles, row_tile, row_value

MASKED_LOGIT = tl.constexpr(-1.0e30)  # logit of a source a query does not read: weight 0, and 0 * it stays finite
RESCALE_MARGIN = tl.constexpr(8.0)  # the forward rescales its mix only when a logit exceeds the reference max by this


@triton.jit
def _inverse_rms(x, rms_ptr, D, eps):
    """r = (mean(x^2) + eps)^(-1/2) over the full row, also stored at `rms_ptr` for the backward."""
    r = tl.rsqrt(tl.sum(x * x) / D + eps)
    tl.store(rms_ptr, r)
    return r


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
def _forward_kernel(
    table, S, S0, S1, u_ptr, out0_ptr, out1_ptr, lse_ptr, rms_ptr, M, M1, D, H, DH, eps,
    BH: tl.constexpr, BDH: tl.constexpr, K0: tl.constexpr, KR: tl.constexpr, ALIGN: tl.constexpr, Q: tl.constexpr,
    LAZY: tl.constexpr,
):  # fmt: skip
    """One row per program, every query at once: source 0 (kind K0), then sources 1.. (kind KR) with two
    loads in flight. Query k reads sources 0 .. Sk - 1 and writes its mix at outk_ptr and its log-sum-exp at
    lse [k, row]. Each source's inverse RMS goes to rms [rows, S]."""
    row = tl.program_id(0).to(tl.int64)
    i0 = row // M1
    i1 = row % M1
    h, hmask, mask, cols = row_tile(H, DH, BH, BDH)
    u0, u1 = query_tiles(u_ptr, D, cols, mask, Q)
    x32, x16 = issue_row(table, 0, True, i0, i1, cols, mask, K0, ALIGN)
    a32, a16 = issue_row(table, 1 % S, 1 < S, i0, i1, cols, mask, KR, ALIGN)
    b32, b16 = issue_row(table, 2 % S, 2 < S, i0, i1, cols, mask, KR, ALIGN)
    m0, z0 = tl.full([BH], float("-inf"), tl.float32), tl.zeros([BH], tl.float32)
    acc0 = tl.zeros([BH, BDH], tl.float32)
    m1, z1, acc1 = m0, z0, acc0
    x = row_value(x32, x16, K0)
    r = _inverse_rms(x, rms_ptr + row * S, D, eps)
    m0, z0, acc0 = _mix_step(x, r, u0, m0, z0, acc0, True, LAZY)
    if Q == 2:
        m1, z1, acc1 = _mix_step(x, r, u1, m1, z1, acc1, True, LAZY)
    for n in range(1, S):
        c32, c16 = issue_row(table, tl.minimum(n + 2, S - 1), n + 2 < S, i0, i1, cols, mask, KR, ALIGN)
        x = row_value(a32, a16, KR)
        r = _inverse_rms(x, rms_ptr + row * S + n, D, eps)
        m0, z0, acc0 = _mix_step(x, r, u0, m0, z0, acc0, n < S0, LAZY)
        if Q == 2:
            m1, z1, acc1 = _mix_step(x, r, u1, m1, z1, acc1, n < S1, LAZY)
        a32, a16, b32, b16 = b32, b16, c32, c16
    tl.store(out0_ptr + row * D + cols, (acc0 / z0[:, None]).to(out0_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + row * H + h, m0 + tl.log(z0), mask=hmask)
    if Q == 2:
        tl.store(out1_ptr + row * D + cols, (acc1 / z1[:, None]).to(out1_ptr.dtype.element_ty), mask=mask)
        tl.store(lse_ptr + (M + row) * H + h, m1 + tl.log(z1), mask=hmask)
