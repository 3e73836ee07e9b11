"""The merged read and the next sublayer's pre-norm: forward in PyTorch ops, backward one fused Triton kernel.

`reference.merge_source` adds one source to a route through its log-sum-exp; the sublayer then applies its
RMSNorm. The forward stays plain ops, which a compiled block fuses with its neighbours at no extra host cost (a
kernel of its own cost more host time than it saved in a 350m step, docs/kernels.md); it also returns a
few statistics per row. From them the backward kernel reads the upstream gradient, the mix and the source once
and writes their gradients, where the compiled backward took several kernels and about twice as long.
Rows are [heads, head size] register tiles (`rows.row_tile`), so per-head values broadcast without gathers.
"""

import torch
import triton
import triton.language as tl
from mhar_lightning.kernels.route_launch import ROW_ELEMS_PER_THREAD, interpreted, launch_shape
from mhar_lightning.kernels.rows import row_tile
from torch import Tensor

MIN_WARPS = 4
BACKWARD_ROWS = 16  # rows per backward program; sets the shape of the parameter gradients' partial sums
DTYPES = (torch.float32, torch.bfloat16)  # row dtypes the kernels read and write


ROUND_BY_BITS = tl.constexpr(interpreted())  # the interpreter's bf16 casts truncate: round to nearest even by hand


@triton.jit
def _rounded(x, ROUND: tl.constexpr):
    """x as stored in bf16 when ROUND: the unfused path keeps s - m, the merged row and its normalised form in
    bf16 tensors when the route and the source are bf16."""
    if ROUND:
        if ROUND_BY_BITS:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
        else:
            x = x.to(tl.bfloat16).to(tl.float32)
    return x


@triton.jit
def _merge_norm_backward_kernel(
    g_ptr, mix_ptr, src_ptr, u_ptr, w_ptr, stats_ptr, dmix_ptr, dlse_ptr, dsrc_ptr, parts_ptr,
    M, D, H, DH, BR: tl.constexpr, BH: tl.constexpr, BDH: tl.constexpr, ROUND: tl.constexpr,
):  # fmt: skip
    """BR rows per program. Through the norm, dx = r_x dn - r_x^3 / D <dn, x> x with dn = w g; through the
    two-way softmax, dm = (1 - a) dx, dt = a (1 - a) <dx, s - m> per head (d lse = -dt, dz = dt), and
    ds = a dx + r_s dt u - r_s^2 / D (sum_h dt z) s. The program's partial sums of du = sum r_s dt s and
    dw = sum g n go to row `program` of parts[0] and parts[1] (reduced by the caller: no atomics)."""
    first = tl.program_id(0).to(tl.int64) * BR
    h, hmask, mask, cols = row_tile(H, DH, BH, BDH)
    u = tl.load(u_ptr + cols, mask=mask, other=0.0)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    du = tl.zeros([BH, BDH], tl.float32)
    dw = tl.zeros([BH, BDH], tl.float32)
    for i in range(tl.minimum(M - first, BR)):
        row = first + i
        at = row * D + cols
        g = tl.load(g_ptr + at, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(src_ptr + at, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(mix_ptr + at, mask=mask, other=0.0).to(tl.float32)
        stats = stats_ptr + row * (2 + 2 * H)
        r_s = tl.load(stats)
        r_x = tl.load(stats + 1)
        a = tl.load(stats + 2 + h, mask=hmask, other=0.0)
        z = tl.load(stats + 2 + H + h, mask=hmask, other=0.0)
        diff = _rounded(s - m, ROUND)
        x = _rounded(m + a[:, None] * diff, ROUND)
        dw += g * _rounded(x * r_x, ROUND)
        dn = g * w
        dx = r_x * dn - (r_x * r_x * r_x / D) * tl.sum(dn * x) * x
        dt = a * (1.0 - a) * tl.sum(dx * diff, axis=1)
        ds = a[:, None] * dx + r_s * dt[:, None] * u - (r_s * r_s / D) * tl.sum(dt * z) * s
        tl.store(dmix_ptr + at, ((1.0 - a)[:, None] * dx).to(dmix_ptr.dtype.element_ty), mask=mask)
        tl.store(dsrc_ptr + at, ds.to(dsrc_ptr.dtype.element_ty), mask=mask)
        tl.store(dlse_ptr + row * H + h, -dt, mask=hmask)
        du += (r_s * dt)[:, None] * s
    at = tl.program_id(0).to(tl.int64) * D + cols
    tl.store(parts_ptr + at, du, mask=mask)
    tl.store(parts_ptr + tl.num_programs(0) * D + at, dw, mask=mask)


def backward_blocks(rows: int) -> int:
    """Programs of the backward kernel: rows of the partial sums of du and dw that `merge_norm_backward` returns."""
    return triton.cdiv(rows, BACKWARD_ROWS)


def merge_norm_forward(
    mix: Tensor,
    lse: Tensor,
    source: Tensor,
    u: Tensor,
    weight: Tensor,
    heads: int,
    eps: float,
    norm_eps: float,
    out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """RMSNorm (gain `weight`, `norm_eps`) of the route `mix`, `lse` ([..., d], [..., heads]) with `source` added
    through the folded query `u` ([d] fp32), computed as `reference.merge_norm` does (s - m, the merged row and its
    normalised form rounded to the rows' dtype), in `out_dtype`; and the statistics the backward kernel reads,
    (r_s, r_x, a per head, z per head) for each row: [rows, 2 + 2 heads] fp32."""
    d = mix.shape[-1]
    s32 = source.float().unflatten(-1, (heads, d // heads))
    # summed per head first, as z is: the compiler then computes both in one pass over the source (the forward's
    # kernels took 55 against 81 us a transformer block at 350m on an H200)
    r_s = torch.rsqrt(s32.square().sum(-1).sum(-1, keepdim=True) / d + eps)
    z = (s32 * u.view(heads, -1)).sum(-1) * r_s
    a = torch.sigmoid(z - lse)
    old = mix.unflatten(-1, (heads, d // heads))
    x = (old + a[..., None] * (source.unflatten(-1, (heads, d // heads)) - old)).flatten(-2)
    x = x.to(torch.promote_types(mix.dtype, source.dtype))
    x32 = x.float()
    r_x = torch.rsqrt(x32.square().mean(-1, keepdim=True) + norm_eps)
    out = weight * (x32 * r_x).type_as(x)
    if out.dtype != out_dtype:  # a no-op `to` as the autograd Function's output lost its gradient (torch 2.11 compile)
        out = out.to(out_dtype)
    return out, torch.cat([r_s, r_x, a, z], -1).view(-1, 2 + 2 * heads)


def merge_norm_backward(
    grad_out: Tensor,
    mix: Tensor,
    source: Tensor,
    u: Tensor,
    weight: Tensor,
    stats: Tensor,
    heads: int,
    grads: tuple[Tensor, Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of `merge_norm_forward` from the statistics it returned (every input contiguous, rows fp32 or bf16):
    d mix, d lse, d source (in their inputs' dtypes, or into `grads`) and the partial sums of du and d weight,
    [2, backward_blocks(rows), d] fp32 (their sums over dim 1 are the two gradients).

    Called once per merged read from compiled code, so it does no more host work than the launch needs."""
    d = mix.shape[-1]
    rows = mix.numel() // d
    if grads is None:
        dlse = torch.empty(*mix.shape[:-1], heads, dtype=torch.float32, device=mix.device)
        grads = torch.empty_like(mix), dlse, torch.empty_like(source)
    parts = torch.empty(2, backward_blocks(rows), d, dtype=torch.float32, device=mix.device)
    bh, bdh, warps = launch_shape(d, heads, ROW_ELEMS_PER_THREAD, MIN_WARPS, interpreted())
    if rows:
        _merge_norm_backward_kernel[(parts.shape[1],)](
            grad_out, mix, source, u, weight, stats, *grads, parts, rows, d, heads, d // heads,
            BR=BACKWARD_ROWS, BH=bh, BDH=bdh, ROUND=mix.dtype == source.dtype == torch.bfloat16, num_warps=warps,
        )  # fmt: skip
    return (*grads, parts)
