"""Depth routing over earlier sublayer outputs: AttnRes (one head) and MHAR (H heads), full or block."""

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from mhar_lightning.config import ModelConfig
from mhar_lightning.kernels import depth_route
from mhar_lightning.kernels.reference import check_heads, depth_weights
from mhar_lightning.residual.base import Residual, Stream, register_residual

KEY_NORM_EPS = 1e-6


class DepthRouter(Residual):
    """Shared machinery of routed strategies: a zero-initialised pseudo-query and a key-RMSNorm gain per site.

    While a capture dict is attached (see `capture_depth_attention`), every routing call also records its
    softmax weights averaged over tokens, shaped [heads, sources]; otherwise capturing costs nothing.
    """

    def __init__(self, heads: int) -> None:
        super().__init__()
        if heads < 1:
            raise ValueError(f"heads must be >= 1, got {heads}")
        self.heads = heads
        self.capture: dict[int, Tensor] | None = None

    def build_sites(self, config: ModelConfig, n_sites: int) -> None:
        check_heads(config.d_model, self.heads)
        self.query = nn.Parameter(torch.empty(n_sites, config.d_model))
        self.key_norm = nn.Parameter(torch.empty(n_sites, config.d_model))

    def reset_parameters(self) -> None:
        if hasattr(self, "query"):
            nn.init.zeros_(self.query)
            nn.init.ones_(self.key_norm)

    def route(self, sources: Stream, l: int) -> Tensor:
        """Mix `sources` with the query of sublayer `l` (l = n_sublayers is the final read)."""
        j = self.site(l)
        if self.capture is not None:
            with torch.no_grad():
                weights = depth_weights(sources, self.query[j], self.key_norm[j], self.heads, KEY_NORM_EPS)
                self.capture[l] = weights.flatten(0, -3).mean(0).float().cpu()
        return depth_route(sources, self.query[j], self.key_norm[j], self.heads, KEY_NORM_EPS)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, {super().extra_repr()}"


@register_residual("mhar")
class MHAR(DepthRouter):
    """Multi-head attention residuals: each of `heads` chunks of d gets its own softmax over depth.

    `blocks=None` routes over every earlier sublayer output (full); `blocks=N` groups the L sublayers into
    N blocks of ceil(L / N) and routes over [embedding, finished block sums, in-block partial sum].
    """

    def __init__(self, heads: int = 8, blocks: int | None = None) -> None:
        super().__init__(heads)
        if blocks is not None and blocks < 1:
            raise ValueError(f"blocks must be >= 1 (or None for full routing), got {blocks}")
        self.blocks = blocks

    def build(self, config: ModelConfig) -> None:
        n = config.n_sublayers
        if self.blocks is not None and self.blocks > n:
            raise ValueError(f"blocks={self.blocks} exceeds the {n} sublayers of a {config.n_layers}-layer model")
        self.block_len = 1 if self.blocks is None else math.ceil(n / self.blocks)
        self.build_sites(config, len(self.sites))

    def read(self, stream: Stream, l: int) -> Tensor:
        return self.route(stream, l)

    def write(self, stream: Stream, l: int, y: Tensor) -> Stream:
        if l % self.block_len == 0:
            return (*stream, y)
        return (*stream[:-1], stream[-1] + y)

    def extra_repr(self) -> str:
        return f"blocks={self.blocks}, {super().extra_repr()}"


@register_residual("attnres")
class AttnRes(MHAR):
    """Kimi's Attention Residuals: MHAR with a single head."""

    def __init__(self, blocks: int | None = None) -> None:
        super().__init__(heads=1, blocks=blocks)


@contextlib.contextmanager
def capture_depth_attention(model: nn.Module) -> Iterator[dict[int, Tensor]]:
    """Record the depth-attention weights of every routing site of `model` while the context is open.

    Yields a dict filled by each forward: sublayer index -> [heads, sources] weights averaged over tokens.
    """
    captured: dict[int, Tensor] = {}
    routers = [m for m in model.modules() if isinstance(m, DepthRouter)]
    for router in routers:
        router.capture = captured
    try:
        yield captured
    finally:
        for router in routers:
            router.capture = None
