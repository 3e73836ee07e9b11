"""Hyper-connections' sublayer boundary: the pure-PyTorch reference, the fused `mhar::hc_boundary` op over the Triton
kernels of `hyper_kernels.py`, and the dispatch between them.

Per token, with n streams H_j ([..., n, d] stacked), a sublayer output y and the sublayer's mix M [n, n] and write
weights w [n], a boundary writes and then weighs and reads for the next sublayer:

    H'_k   = w_k y + sum_j M_jk H_j                          (no write: H' = H)
    a_k    = tanh(RMS(H'_k)^-1 H'_k W)                       W: [d, n + 2], the next sublayer's dynamic projection
    read'  = read0 + s_a a[:, 0];  M' = mix0 + s_a a[:, 1 : n + 1];  w' = write0 + s_b a[:, n + 1]
    x      = sum_k read'_k H'_k                              the next sublayer's input (before its pre-norm)

The reference takes the same arguments and is the CPU path and the tests' ground truth. The fused op reads the
streams once for the write, the norms and the projection, and once more (from L2) for the read.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from mhar_lightning.kernels import resolve_backend


def written(h: Tensor, y: Tensor, mix: Tensor, write: Tensor) -> Tensor:
    """H'_k = write_k y + sum_j mix_jk H_j on stacked streams [..., n, d]: unrolled over j, as products that Inductor
    fuses into one pass (an einsum becomes a batched matrix product of n x n by n x d per token)."""
    mixed = sum(mix[..., j, :, None] * h[..., j, None, :] for j in range(h.shape[-2]))
    return write[..., None] * y[..., None, :] + mixed


def weighted(weights: Tensor, h: Tensor) -> Tensor:
    """sum_k weights_k H_k on stacked streams [..., n, d], unrolled as in `written`."""
    return sum(weights[..., k, None] * h[..., k, :] for k in range(h.shape[-2]))


def boundary_reference(
    h: Tensor, y: Tensor | None, mix: Tensor | None, write: Tensor | None, w: Tensor, read0: Tensor, mix0: Tensor,
    write0: Tensor, scale: Tensor, eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """New streams [..., n, d] (h itself without a write), read [..., n], mix [..., n, n], write [..., n] and the
    next input x [..., d]."""
    n = h.shape[-2]
    if y is not None:
        h = written(h, y, mix, write)
    stats = h.to(torch.promote_types(h.dtype, torch.float32))
    normed = (stats * torch.rsqrt(stats.square().mean(-1, keepdim=True) + eps)).to(h.dtype)
    terms = torch.tanh(normed @ w.to(normed.dtype))
    read = read0 + scale[0] * terms[..., 0]
    x = weighted(read, h)
    return h, read, mix0 + scale[0] * terms[..., 1 : n + 1], write0 + scale[1] * terms[..., n + 1], x


@torch.library.custom_op("mhar::hc_boundary", mutates_args=())
def _boundary(
    h: Tensor, y: Tensor | None, mix: Tensor | None, write: Tensor | None, w: Tensor, read0: Tensor, mix0: Tensor,
    write0: Tensor, scale: Tensor, eps: float, low_precision: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    from mhar_lightning.kernels import hyper_kernels

    hn, read, mixn, writen, x, r, z = hyper_kernels.boundary_forward(
        h, y, mix, write, w, read0, mix0, write0, scale, eps, low_precision
    )
    return (h.new_empty(0) if hn is None else hn), read, mixn, writen, x, r, z


@_boundary.register_fake
def _(h, y, mix, write, w, read0, mix0, write0, scale, eps, low_precision):
    tokens, n, d = h.shape
    hn = h.new_empty(0) if y is None else torch.empty_like(h)
    f32 = torch.float32
    return (hn, h.new_empty(tokens, n), h.new_empty(tokens, n, n), h.new_empty(tokens, n), h.new_empty(tokens, d),
            h.new_empty(tokens, n, dtype=f32), h.new_empty(tokens, n, w.shape[1], dtype=f32))  # fmt: skip


@torch.library.custom_op("mhar::hc_boundary_backward", mutates_args=())
def _boundary_backward(
    h: Tensor, y: Tensor | None, mix: Tensor | None, write: Tensor | None, w: Tensor, scale: Tensor, hn: Tensor,
    read: Tensor, r: Tensor, z: Tensor, g_hn: Tensor | None, g_x: Tensor, g_read: Tensor, g_mixn: Tensor,
    g_writen: Tensor, low_precision: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    from mhar_lightning.kernels import hyper_kernels

    out = hyper_kernels.boundary_backward(h, y, mix, write, w, scale, hn if y is not None else None, read, r, z,
                                          g_hn, g_x, g_read, g_mixn, g_writen, low_precision)  # fmt: skip
    return tuple(h.new_empty(0) if t is None else t for t in out)


@_boundary_backward.register_fake
def _(h, y, mix, write, w, scale, hn, read, r, z, g_hn, g_x, g_read, g_mixn, g_writen, low_precision):
    tokens, n, _ = h.shape
    written = [h.new_empty(0) if y is None else torch.empty_like(t) for t in (y, mix, write)]
    f32 = torch.float32
    return (torch.empty_like(h), *written, h.new_empty(tokens, n, w.shape[1], dtype=f32),
            h.new_empty(tokens, n, dtype=f32), h.new_empty(tokens, n, 2, dtype=f32))  # fmt: skip


def _setup_context(ctx, inputs, output) -> None:
    h, y, mix, write, w, read0, mix0, write0, scale, eps, low_precision = inputs
    hn, read, _, _, _, r, z = output
    ctx.save_for_backward(h, y, mix, write, w, scale, hn, read, r, z)
    ctx.low_precision = low_precision


def _backward(ctx, g_hn, g_read, g_mixn, g_writen, g_x, _g_r, _g_z):
    h, y, mix, write, w, scale, hn, read, r, z = ctx.saved_tensors
    tokens, n, d = h.shape
    g_x = h.new_zeros(tokens, d) if g_x is None else g_x
    g_read = torch.zeros_like(read) if g_read is None else g_read
    g_mixn = h.new_zeros(tokens, n, n) if g_mixn is None else g_mixn
    g_writen = torch.zeros_like(read) if g_writen is None else g_writen
    write_step = y is not None
    g_h, g_y, g_mix, g_write, g_p, g_read_total, g_scale = _boundary_backward(
        h, y, mix, write, w, scale, hn, read, r, z, g_hn if write_step else None, g_x, g_read, g_mixn, g_writen,
        ctx.low_precision,
    )  # fmt: skip
    streams = (hn if write_step else h).reshape(-1, d).t()  # a transposed view: the product copies nothing
    g_w = torch.mm(streams.to(g_p.dtype), g_p.reshape(-1, g_p.shape[-1])).to(w.dtype)
    if not write_step:
        g_y = g_mix = g_write = None
    return (g_h, g_y, g_mix, g_write, g_w, g_read_total.sum(0), g_mixn.sum(0), g_writen.sum(0), g_scale.sum((0, 1)),
            None, None)  # fmt: skip


_boundary.register_autograd(_backward, setup_context=_setup_context)


def hc_boundary(
    h: Tensor, y: Tensor | None, mix: Tensor | None, write: Tensor | None, w: Tensor, read0: Tensor, mix0: Tensor,
    write0: Tensor, scale: Tensor, eps: float, backend: str = "auto",
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """One boundary (see the module docstring) on the chosen backend: new streams, read, mix, write and x, shaped as
    `boundary_reference` returns them. The fused op needs a power-of-two stream count and a width that is a
    multiple of 16; elsewhere the reference runs."""
    from mhar_lightning.kernels import hyper_kernels

    n, d = h.shape[-2:]
    fused = n & (n - 1) == 0 and n <= 16 and hyper_kernels.columns(d) > 0
    if not fused or resolve_backend(backend, [h]) == "reference":
        return boundary_reference(h, y, mix, write, w, read0, mix0, write0, scale, eps)
    lead = h.shape[:-2]
    cp = hyper_kernels.projection_columns(n)
    flat = lambda t, *shape: None if t is None else t.reshape(-1, *shape).contiguous()  # noqa: E731
    hn, read, mixn, writen, x, _, _ = _boundary(
        flat(h, n, d), flat(y, d), flat(mix, n, n), flat(write, n), F.pad(w, (0, cp - w.shape[1])).contiguous(),
        read0.contiguous(), mix0.contiguous(), write0.contiguous(), scale.contiguous(), eps,
        torch.is_autocast_enabled(h.device.type),
    )  # fmt: skip
    return (h if y is None else hn.view(*lead, n, d), read.view(*lead, n), mixn.view(*lead, n, n),
            writen.view(*lead, n), x.view(*lead, d))  # fmt: skip
