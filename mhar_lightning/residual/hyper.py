"""Hyper-connections (Zhu et al., "Hyper-Connections", ICLR 2025): n parallel residual streams with learned mixing."""

from types import MappingProxyType

import torch
from torch import Tensor, nn

from mhar_lightning.config import ModelConfig
from mhar_lightning.residual.base import Residual, Stream, register_residual

DYNAMIC_SCALE_INIT = 0.01


def unit_rms(x: Tensor, eps: float) -> Tensor:
    """x / RMS(x) over the last dimension, statistics in at least fp32, in x's dtype."""
    stats = x.to(torch.promote_types(x.dtype, torch.float32))
    return (stats * torch.rsqrt(stats.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


def weighted_sum(weights: Tensor, streams: Stream) -> Tensor:
    """sum_j weights[..., j] * streams[j]: `weights` is [n] (static) or [..., n] per token."""
    out = weights[..., 0, None] * streams[0]
    for j in range(1, len(streams)):
        out = out + weights[..., j, None] * streams[j]
    return out


@register_residual("hyper-connections")
class HyperConnections(Residual):
    """`rate` copies H_0 .. H_{n-1} of the residual stream. Sublayer l reads and writes

        x_l  = sum_j A_m[j] H_j ;   H'_k = B[k] y_l + sum_j A_r[j, k] H_j

    with per-site weights that start as the Pre-Norm residual (A_m one-hot on stream l mod n, A_r = I, B = 1),
    so at init every stream equals the `sum` model's stream. `dynamic` adds input-dependent terms per stream j,
    `s_a * tanh(norm(H_j) W_a)` to A_m[j] and row j of A_r and `s_b * tanh(norm(H_j) w_b)` to B[j], with W zero
    and the scales 0.01 at init. The final read is the mean of the streams (exact at init too).

    The static weights are stored as offsets from that initialisation, so every parameter starts as zeros or a
    constant (which initialises sharded FSDP2 parameters as well as whole ones). Stream: the n streams between
    transformer blocks; inside a block also the read, mix and write weights of the next sublayer, computed from
    the streams it reads and used again by its write.
    """

    weights_are_distributions = False  # read weights of any sign, not a softmax
    # On an H200 (torch 2.11, Triton 3.6) Inductor's no-grad graphs with fusions of more than 4 nodes gave logits
    # off by as much as the logits; at 4 they agree with eager to bf16 rounding. Training graphs were right.
    no_grad_inductor_options = MappingProxyType({"max_fusion_size": 4})

    def __init__(self, rate: int = 4, dynamic: bool = True) -> None:
        super().__init__()
        if rate < 1:
            raise ValueError(f"rate must be >= 1 stream, got {rate}")
        self.rate = rate
        self.dynamic = dynamic

    def build(self, config: ModelConfig) -> None:
        self.norm_eps = config.norm_eps
        if self.sites.start == config.n_sublayers:  # the final read: the mean of the streams, no parameters
            return
        n, sites = self.rate, len(self.sites)
        self.read_offset = nn.Parameter(torch.empty(sites, n))
        self.mix_offset = nn.Parameter(torch.empty(sites, n, n))
        self.write_offset = nn.Parameter(torch.empty(sites, n))
        if self.dynamic:
            self.dynamic_proj = nn.Parameter(torch.empty(sites, config.d_model, n + 2))  # columns: A_m, A_r row, B
            self.dynamic_scale = nn.Parameter(torch.empty(sites, 2))  # s_a (A_m and A_r), s_b (B)

    def reset_parameters(self) -> None:
        for name in ("read_offset", "mix_offset", "write_offset", "dynamic_proj"):
            if hasattr(self, name):
                nn.init.zeros_(getattr(self, name))
        if hasattr(self, "dynamic_scale"):
            nn.init.constant_(self.dynamic_scale, DYNAMIC_SCALE_INIT)

    def static_weights(self, l: int) -> tuple[Tensor, Tensor, Tensor]:
        """A_m [n], A_r [n, n] and B [n] of sublayer `l` before the dynamic terms."""
        j = self.site(l)
        eye = torch.eye(self.rate, device=self.read_offset.device, dtype=self.read_offset.dtype)
        return eye[l % self.rate] + self.read_offset[j], eye + self.mix_offset[j], 1 + self.write_offset[j]

    def weights(self, streams: Stream, l: int) -> tuple[Tensor, Tensor, Tensor]:
        """Sublayer `l`'s read [..., n], mix [..., n, n] and write [..., n] weights for `streams` (static: no `...`)."""
        read, mix, write = self.static_weights(l)
        if not self.dynamic:
            return read, mix, write
        j = self.site(l)
        # One matrix product for all n streams, not n products stacked: one launch, and no products written into
        # slices of a stacked buffer.
        normed = torch.stack([unit_rms(h, self.norm_eps) for h in streams], -2)  # [..., n, d]
        terms = torch.tanh(normed @ self.dynamic_proj[j].to(normed.dtype))  # [..., n, n + 2]
        scale_a, scale_b = self.dynamic_scale[j, 0], self.dynamic_scale[j, 1]
        return read + scale_a * terms[..., 0], mix + scale_a * terms[..., 1:-1], write + scale_b * terms[..., -1]

    def start(self, embedding: Tensor) -> Stream:
        return (embedding,) * self.rate

    def enter(self, stream: Stream, l: int) -> Stream:
        return (*stream, *self.weights(stream, l))

    def read(self, stream: Stream, l: int) -> Tensor:
        streams = stream[: self.rate]
        if l == self.n_sublayers:
            # A tensor of weights, not `/ rate`: compiled autograd (torch 2.11, CUDA) fails on a Python int saved by
            # this eager op outside the compiled blocks.
            mean = torch.full((self.rate,), 1 / self.rate, device=streams[0].device, dtype=streams[0].dtype)
            if self.capture is not None:
                self.record(l, mean[None].cpu())
            return weighted_sum(mean, streams)
        read, mix, write = stream[self.rate :]
        if self.capture is not None:
            self.record_site(l, read, mix, write)
        return weighted_sum(read, streams)

    def write(self, stream: Stream, l: int, y: Tensor) -> Stream:
        streams, (_, mix, write) = stream[: self.rate], stream[self.rate :]
        new = tuple(write[..., k, None] * y + weighted_sum(mix[..., k], streams) for k in range(self.rate))
        return (*new, *self.weights(new, l + 1)) if self.site(l) == 0 else new

    def record_site(self, l: int, read: Tensor, mix: Tensor, write: Tensor) -> None:
        """Record the read weights over the streams and, as scalars, the write weights and the mean self / cross mix."""
        with torch.no_grad():
            eye = torch.eye(self.rate, dtype=torch.bool, device=mix.device)
            scalars = {f"hc_write_{k}": write[..., k] for k in range(self.rate)}
            scalars["hc_mix_self"] = mix[..., eye].mean(-1)
            if self.rate > 1:
                scalars["hc_mix_cross"] = mix[..., ~eye].mean(-1)
            self.record(l, read[..., None, :], **scalars)

    def source_labels(self) -> tuple[str, ...]:
        return tuple(f"stream {k}" for k in range(self.rate))

    def extra_repr(self) -> str:
        return f"rate={self.rate}, dynamic={self.dynamic}, {super().extra_repr()}"
