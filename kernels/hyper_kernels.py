"""Fused hyper-connections sublayer boundary: Triton kernels for the forward and backward, and their launchers.

What they compute is stated once, in `hyper_connections.boundary_reference`. A program owns R tokens, that is
R x n stream rows (one [R n, BD] tile per chunk of BD columns), and walks the width twice: the first pass writes the
new streams and accumulates their squares and their projection on the dynamic weights (a tensor-core product:
RMS(x) comes out of a linear map, so the row need not be normalised first), the second reads the new streams back
(from L2: a program's rows were just written) for the next sublayer's read. The backward recomputes nothing it can
load: a first pass reduces <grad x, H'_k>, a second forms each new stream's total gradient and from it every input's.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

ROWS = 64  # stream rows a program owns (R = ROWS / n tokens): tl.dot needs 16
COLUMNS = 64  # columns a pass handles at once
WARPS = 4
STAGES = 2  # software-pipelining depth of the column loops


@triton.jit
def _tanh(x):
    e = tl.exp(-2.0 * tl.abs(x))
    return tl.where(x >= 0, 1.0, -1.0) * (1.0 - e) / (1.0 + e)


@triton.jit
def _tiles(T, N: tl.constexpr, R: tl.constexpr):
    """Token, stream and token mask of the program's R N stream rows (row m is stream m % N of token m // N)."""
    m = tl.arange(0, R * N)
    t = tl.program_id(0) * R + m // N
    return t.to(tl.int64), m % N, t < T


@triton.jit
def _boundary_forward_kernel(
    h_ptr, y_ptr, mix_ptr, write_ptr, w_ptr, read0_ptr, mix0_ptr, write0_ptr, scale_ptr,
    hn_ptr, read_ptr, mixn_ptr, writen_ptr, x_ptr, r_ptr, z_ptr, T, D, eps,
    N: tl.constexpr, R: tl.constexpr, BD: tl.constexpr, CP: tl.constexpr, WRITE: tl.constexpr, F32: tl.constexpr,
):  # fmt: skip
    """H' = write y + mix^T H (if WRITE, else H' = H), then the next weights from tanh(RMS(H'_k) H'_k W) and the read
    x = sum_k read_k H'_k. Saves r_k = 1 / RMS(H'_k) and the pre-activations z for the backward."""
    t, k, tm = _tiles(T, N, R)
    c = tl.arange(0, CP)
    rows = t[:, None] * N + k[:, None]
    sumsq = tl.zeros([R * N], tl.float32)
    proj = tl.zeros([R * N, CP], tl.float32)
    if WRITE:
        wk = tl.load(write_ptr + t * N + k, mask=tm, other=0.0)
    for c0 in range(0, D, BD):
        cols = c0 + tl.arange(0, BD)
        if WRITE:
            acc = wk[:, None] * tl.load(y_ptr + t[:, None] * D + cols[None, :], mask=tm[:, None], other=0.0).to(
                tl.float32
            )
            for j in tl.static_range(N):
                mjk = tl.load(mix_ptr + (t * N + j) * N + k, mask=tm, other=0.0)
                acc += mjk[:, None] * tl.load(
                    h_ptr + (t[:, None] * N + j) * D + cols[None, :], mask=tm[:, None], other=0.0
                ).to(tl.float32)
            tl.store(hn_ptr + rows * D + cols[None, :], acc, mask=tm[:, None])
        else:
            acc = tl.load(h_ptr + rows * D + cols[None, :], mask=tm[:, None], other=0.0).to(tl.float32)
        sumsq += tl.sum(acc * acc, axis=1)
        wc = tl.load(w_ptr + cols[:, None] * CP + c[None, :])
        if F32:
            proj += tl.dot(acc, wc, input_precision="ieee")
        else:
            proj += tl.dot(acc.to(tl.bfloat16), wc)
    r = tl.rsqrt(sumsq / D + eps)
    z = r[:, None] * proj
    tl.store(r_ptr + t * N + k, r, mask=tm)
    tl.store(z_ptr + rows * CP + c[None, :], z, mask=tm[:, None])
    a = _tanh(z)
    s_a = tl.load(scale_ptr)
    s_b = tl.load(scale_ptr + 1)
    # per stream k: column 0 its read weight, 1 .. N its row of the mix, N + 1 its write weight
    read = tl.load(read0_ptr + k) + s_a * tl.sum(tl.where(c[None, :] == 0, a, 0.0), axis=1)
    tl.store(read_ptr + t * N + k, read, mask=tm)
    tl.store(writen_ptr + t * N + k, tl.load(write0_ptr + k) + s_b * tl.sum(tl.where(c[None, :] == N + 1, a, 0.0), 1),
             mask=tm)  # fmt: skip
    in_mix = (c >= 1) & (c <= N)
    mix0 = tl.load(mix0_ptr + k[:, None] * N + c[None, :] - 1, mask=in_mix[None, :], other=0.0)
    tl.store(mixn_ptr + rows * N + c[None, :] - 1, mix0 + s_a * a, mask=tm[:, None] & in_mix[None, :])
    tl.debug_barrier()  # the read weights and new streams stored above are read back by other threads
    tr = tl.program_id(0) * R + tl.arange(0, R)
    trm = tr < T
    tr = tr.to(tl.int64)
    if WRITE:
        src_ptr = hn_ptr
    else:
        src_ptr = h_ptr
    for c0 in range(0, D, BD):
        cols = c0 + tl.arange(0, BD)
        x = tl.zeros([R, BD], tl.float32)
        for j in tl.static_range(N):
            rj = tl.load(read_ptr + tr * N + j, mask=trm, other=0.0)
            hj = tl.load(src_ptr + (tr[:, None] * N + j) * D + cols[None, :], mask=trm[:, None], other=0.0)
            x += rj[:, None] * hj.to(tl.float32)
        tl.store(x_ptr + tr[:, None] * D + cols[None, :], x, mask=trm[:, None])


@triton.jit
def _boundary_backward_kernel(
    h_ptr, y_ptr, mix_ptr, write_ptr, w_ptr, scale_ptr, hn_ptr, read_ptr, r_ptr, z_ptr,
    g_hn_ptr, g_x_ptr, g_read_ptr, g_mixn_ptr, g_writen_ptr,
    g_h_ptr, g_y_ptr, g_mix_ptr, g_write_ptr, g_p_ptr, g_read_total_ptr, g_scale_ptr, T, D,
    N: tl.constexpr, R: tl.constexpr, BD: tl.constexpr, CP: tl.constexpr, WRITE: tl.constexpr, G_HN: tl.constexpr,
    F32: tl.constexpr,
):  # fmt: skip
    """Gradients of `_boundary_forward_kernel`'s inputs. Per row: G_k = g H'_k + read_k g x + (g z_k r_k) W^T
    - (r_k^2 / D) <g z_k, z_k> H'_k, then g y = sum_k write_k G_k, g H_j = sum_k mix_jk G_k,
    g mix_jk = <G_k, H_j>, g write_k = <G_k, y> (without WRITE, g H = G). Writes r_k g z_k (for g W, summed over
    tokens by the caller), the read weights' total gradient and the two scales' per-row gradients."""
    t, k, tm = _tiles(T, N, R)
    c = tl.arange(0, CP)
    rows = t[:, None] * N + k[:, None]
    if WRITE:
        src_ptr = hn_ptr
    else:
        src_ptr = h_ptr
    dot_x = tl.zeros([R * N], tl.float32)
    for c0 in range(0, D, BD):
        cols = c0 + tl.arange(0, BD)
        hn = tl.load(src_ptr + rows * D + cols[None, :], mask=tm[:, None], other=0.0).to(tl.float32)
        gx = tl.load(g_x_ptr + t[:, None] * D + cols[None, :], mask=tm[:, None], other=0.0).to(tl.float32)
        dot_x += tl.sum(hn * gx, axis=1)
    s_a = tl.load(scale_ptr)
    s_b = tl.load(scale_ptr + 1)
    r = tl.load(r_ptr + t * N + k, mask=tm, other=1.0)
    z = tl.load(z_ptr + rows * CP + c[None, :], mask=tm[:, None], other=0.0)
    a = _tanh(z)
    g_read = tl.load(g_read_ptr + t * N + k, mask=tm, other=0.0) + dot_x
    g_writen = tl.load(g_writen_ptr + t * N + k, mask=tm, other=0.0)
    in_mix = (c >= 1) & (c <= N)
    g_mixn = tl.load(g_mixn_ptr + rows * N + c[None, :] - 1, mask=tm[:, None] & in_mix[None, :], other=0.0)
    g_a = tl.where(c[None, :] == 0, s_a * g_read[:, None], s_a * g_mixn)
    g_a = tl.where(c[None, :] == N + 1, s_b * g_writen[:, None], g_a)
    g_z = g_a * (1.0 - a * a)
    g_p = r[:, None] * g_z
    norm_coef = -tl.sum(g_z * z, axis=1) * r * r / D
    tl.store(g_p_ptr + rows * CP + c[None, :], g_p, mask=tm[:, None])
    tl.store(g_read_total_ptr + t * N + k, g_read, mask=tm)
    g_sa = g_read * tl.sum(tl.where(c[None, :] == 0, a, 0.0), axis=1) + tl.sum(g_mixn * a, axis=1)
    tl.store(g_scale_ptr + (t * N + k) * 2, g_sa, mask=tm)
    tl.store(g_scale_ptr + (t * N + k) * 2 + 1, g_writen * tl.sum(tl.where(c[None, :] == N + 1, a, 0.0), axis=1),
             mask=tm)  # fmt: skip
    read = tl.load(read_ptr + t * N + k, mask=tm, other=0.0)
    tr = tl.program_id(0) * R + tl.arange(0, R)
    trm = tr < T
    tr = tr.to(tl.int64)
    if WRITE:
        wk = tl.load(write_ptr + t * N + k, mask=tm, other=0.0)
        g_wk = tl.zeros([R * N], tl.float32)
        g_mix = tl.zeros([R * N, N], tl.float32)
    jn = tl.arange(0, N)
    for c0 in range(0, D, BD):
        cols = c0 + tl.arange(0, BD)
        hn = tl.load(src_ptr + rows * D + cols[None, :], mask=tm[:, None], other=0.0).to(tl.float32)
        gx = tl.load(g_x_ptr + t[:, None] * D + cols[None, :], mask=tm[:, None], other=0.0).to(tl.float32)
        wt = tl.load(w_ptr + cols[None, :] * CP + c[:, None])  # W^T, [CP, BD]
        if F32:
            g = tl.dot(g_p, wt, input_precision="ieee")
        else:
            g = tl.dot(g_p.to(tl.bfloat16), wt)
        g += read[:, None] * gx + norm_coef[:, None] * hn
        if G_HN:
            g += tl.load(g_hn_ptr + rows * D + cols[None, :], mask=tm[:, None], other=0.0).to(tl.float32)
        if WRITE:
            y = tl.load(y_ptr + t[:, None] * D + cols[None, :], mask=tm[:, None], other=0.0).to(tl.float32)
            g_wk += tl.sum(g * y, axis=1)
            g_y = tl.sum(tl.reshape(wk[:, None] * g, [R, N, BD]), axis=1)
            tl.store(g_y_ptr + tr[:, None] * D + cols[None, :], g_y.to(g_y_ptr.dtype.element_ty), mask=trm[:, None])
            for j in tl.static_range(N):
                mjk = tl.load(mix_ptr + (t * N + j) * N + k, mask=tm, other=0.0)
                g_hj = tl.sum(tl.reshape(mjk[:, None] * g, [R, N, BD]), axis=1)
                tl.store(g_h_ptr + (tr[:, None] * N + j) * D + cols[None, :], g_hj, mask=trm[:, None])
                hj = tl.load(h_ptr + (t[:, None] * N + j) * D + cols[None, :], mask=tm[:, None], other=0.0).to(
                    tl.float32
                )
                g_mix += tl.where(jn[None, :] == j, tl.sum(g * hj, axis=1)[:, None], 0.0)
        else:
            tl.store(g_h_ptr + rows * D + cols[None, :], g, mask=tm[:, None])
    if WRITE:
        tl.store(g_write_ptr + t * N + k, g_wk, mask=tm)
        tl.store(g_mix_ptr + (t[:, None] * N + jn[None, :]) * N + k[:, None], g_mix, mask=tm[:, None])


def projection_columns(n: int) -> int:
    """Columns of the padded dynamic projection: n + 2, at least 16 (tl.dot's smallest tile)."""
    return max(16, triton.next_power_of_2(n + 2))


def columns(d: int) -> int:
    """Columns a pass handles: the largest power of two up to COLUMNS that divides d (0 if under 16: unsupported)."""
    bd = COLUMNS
    while d % bd:
        bd //= 2
    return bd if bd >= 16 else 0


def _grid(tokens: int, n: int) -> tuple[tuple[int], int]:
    per_program = max(1, ROWS // n)
    return (triton.cdiv(tokens, per_program),), per_program


def boundary_forward(
    h: Tensor, y: Tensor | None, mix: Tensor | None, write: Tensor | None, w: Tensor, read0: Tensor, mix0: Tensor,
    write0: Tensor, scale: Tensor, eps: float, low_precision: bool,
) -> tuple[Tensor | None, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """Launch the forward on [T, n, d] streams (y [T, d], mix [T, n, n], write [T, n], or all None for no write),
    w the padded projection [d, CP]: new streams (None without a write), read [T, n], mix [T, n, n], write [T, n],
    the read x [T, d] (fp32), and r [T, n], z [T, n, CP] for the backward. `low_precision`: the projection in bf16,
    as under autocast (never under the interpreter, whose bf16 products are wrong)."""
    tokens, n, d = h.shape
    cp = w.shape[1]
    f32 = h.device.type == "cpu" or not low_precision
    grid, per_program = _grid(tokens, n)
    hn = torch.empty_like(h) if y is not None else None
    read, writen = h.new_empty(tokens, n), h.new_empty(tokens, n)
    mixn, x = h.new_empty(tokens, n, n), h.new_empty(tokens, d)
    r, z = h.new_empty(tokens, n, dtype=torch.float32), h.new_empty(tokens, n, cp, dtype=torch.float32)
    _boundary_forward_kernel[grid](
        h, y, mix, write, w.float() if f32 else w.to(torch.bfloat16), read0, mix0, write0, scale,
        hn, read, mixn, writen, x, r, z, tokens, d, eps,
        N=n, R=per_program, BD=columns(d), CP=cp, WRITE=y is not None, F32=f32,
        num_warps=WARPS, num_stages=STAGES,
    )  # fmt: skip
    return hn, read, mixn, writen, x, r, z


def boundary_backward(
    h: Tensor, y: Tensor | None, mix: Tensor | None, write: Tensor | None, w: Tensor, scale: Tensor,
    hn: Tensor | None, read: Tensor, r: Tensor, z: Tensor,
    g_hn: Tensor | None, g_x: Tensor, g_read: Tensor, g_mixn: Tensor, g_writen: Tensor, low_precision: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None, Tensor, Tensor, Tensor]:  # fmt: skip
    """Launch the backward: g h, g y, g mix, g write (the last three None without a write), r g z [T, n, CP]
    (for g w), the read weights' total gradient [T, n] and the scales' per-row gradients [T, n, 2]."""
    tokens, n, d = h.shape
    cp = w.shape[1]
    f32 = h.device.type == "cpu" or not low_precision
    grid, per_program = _grid(tokens, n)
    write_step = y is not None
    g_h = torch.empty_like(h)
    g_y = torch.empty_like(y) if write_step else None
    g_mix = torch.empty_like(mix) if write_step else None
    g_write = torch.empty_like(write) if write_step else None
    g_p, g_read_total, g_scale = (h.new_empty(*shape, dtype=torch.float32) for shape in ((tokens, n, cp), (tokens, n),
                                                                                      (tokens, n, 2)))  # fmt: skip
    _boundary_backward_kernel[grid](
        h, y, mix, write, w.float() if f32 else w.to(torch.bfloat16), scale, hn, read, r, z,
        None if g_hn is None else g_hn.contiguous(), g_x.contiguous(), g_read.contiguous(), g_mixn.contiguous(),
        g_writen.contiguous(),
        g_h, g_y, g_mix, g_write, g_p, g_read_total, g_scale, tokens, d,
        N=n, R=per_program, BD=columns(d), CP=cp, WRITE=write_step,
        G_HN=g_hn is not None, F32=f32,
        num_warps=WARPS, num_stages=STAGES,
    )  # fmt: skip
    return g_h, g_y, g_mix, g_write, g_p, g_read_total, g_scale
