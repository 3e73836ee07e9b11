"""Delta-MHAR: a gated MHAR read added to an untouched residual stream (identity at init)."""

import torch
from torch import Tensor, nn

from mhar_lightning.config import ModelConfig
from mhar_lightning.residual.base import Stream, register_residual
from mhar_lightning.residual.routed import DepthRouter, routing_source


@register_residual("delta-mhar")
class DeltaMHAR(DepthRouter):
    """h_l = p_l + a_l * MHAR_l([null, embedding, finished block deltas]); p_{l+1} = p_l + y_l.

    The gate `a_l` starts at zero, so a converted pretrained model computes exactly what it did before.
    A block spans `block_size` transformer blocks; its delta is p at its end minus p at its start, kept in
    the dtype of the sublayer outputs (bf16 under autocast, like MHAR's block sums and the embedding source;
    p itself stays fp32), which halves what every later routing call reads.
    Both sublayers of a transformer block read the same sources, so `enter` routes them in one pass (each
    source is read once and its gradient written once per transformer block) and keeps the two mixes in the
    stream until the block's last write, as the route's two outputs: each read's gradient reaches the route's
    backward as it is (a stacked [2, ..., d] mix cost an extra kernel a block to build its gradient).
    Stream layout: (p, p at the start of the current block, null, embedding, delta_1, ...); inside a
    transformer block the attention's and the MLP's mixes follow the block start.
    """

    def __init__(self, heads: int = 8, block_size: int = 4) -> None:
        super().__init__(heads)
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 transformer block, got {block_size}")
        self.block_size = block_size

    def build(self, config: ModelConfig) -> None:
        if self.block_size > config.n_layers:
            raise ValueError(f"block_size={self.block_size} exceeds the model's {config.n_layers} transformer blocks")
        self.block_len = 2 * self.block_size
        if self.sites.start == config.n_sublayers:
            self.null = nn.Parameter(torch.empty(config.d_model))
            return
        self.build_sites(config, len(self.sites))
        self.gate = nn.Parameter(torch.empty(len(self.sites)))

    def reset_parameters(self) -> None:
        super().reset_parameters()
        for name in ("null", "gate"):
            if hasattr(self, name):
                nn.init.zeros_(getattr(self, name))

    def start(self, embedding: Tensor) -> Stream:
        source = routing_source(embedding)
        return (embedding, embedding, self.null.to(source.dtype).expand_as(source), source)

    def enter(self, stream: Stream, l: int) -> Stream:
        p, block_start, *sources = stream
        mixes, _ = self.route_shared(sources, l, counts=(len(sources), len(sources)))
        return (p, block_start, *mixes, *sources)

    def read(self, stream: Stream, l: int) -> Tensor:
        p, _, mix_attn, mix_mlp, *sources = stream
        gate = self.gate[self.site(l)]
        self.record_route(sources, l, delta_gate=gate)
        return p + gate * (mix_attn, mix_mlp)[self.site(l)]

    def source_labels(self) -> tuple[str, ...]:
        """`null, emb, Δ block 1, ...`: the block deltas of the untouched residual stream."""
        return ("null", "emb", *(f"Δ block {b}" for b in range(1, (self.n_sublayers - 1) // self.block_len + 1)))

    def site_sources(self, l: int) -> tuple[int, ...]:
        return tuple(range(2 + l // self.block_len))

    def write(self, stream: Stream, l: int, y: Tensor) -> Stream:
        p, block_start, mix_attn, mix_mlp, *sources = stream
        p = p + y
        if self.site(l) == 0:
            return (p, block_start, mix_attn, mix_mlp, *sources)
        if (l + 1) % self.block_len == 0:
            return (p, p, *sources, (p - block_start).to(y.dtype))
        return (p, block_start, *sources)

    def finish(self, stream: Stream) -> Tensor:
        return stream[0]

    def extra_repr(self) -> str:
        return f"block_size={self.block_size}, {super().extra_repr()}"
