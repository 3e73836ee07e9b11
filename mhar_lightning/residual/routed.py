"""Depth routing over earlier sublayer outputs: AttnRes (one head) and MHAR (H heads), full or block."""

import math

import torch
from torch import Tensor, nn

from mhar_lightning.config import ModelConfig
from mhar_lightning.kernels import KEY_NORM_EPS, RouteQuery, depth_route, depth_route_lse, merge_norm, merge_source
from mhar_lightning.kernels.query import check_heads
from mhar_lightning.kernels.reference import depth_weights
from mhar_lightning.norm import RMSNorm
from mhar_lightning.residual.base import Residual, Stream, register_residual, sublayer_label


def routing_source(embedding: Tensor) -> Tensor:
    """The embedding as a routing source: in the autocast dtype while autocast is on, like the sublayer outputs.

    An fp32 source would make every routing call read it, write its gradient and produce its mix in fp32.
    """
    device = embedding.device.type
    if torch.is_autocast_enabled(device):
        return embedding.to(torch.get_autocast_dtype(device))
    return embedding


class DepthRouter(Residual):
    """Shared machinery of routed strategies: a zero-initialised pseudo-query and a key-RMSNorm gain per site.

    While a capture is attached (see `capture_sites`), every routing call also records its softmax weights
    and its RMS-normalised source keys (what the queries are matched against); otherwise capturing costs nothing.
    """

    def __init__(self, heads: int) -> None:
        super().__init__()
        if heads < 1:
            raise ValueError(f"heads must be >= 1, got {heads}")
        self.heads = heads

    def build_sites(self, config: ModelConfig, n_sites: int) -> None:
        check_heads(config.d_model, self.heads)
        self.query = nn.Parameter(torch.empty(n_sites, config.d_model))
        self.key_norm = nn.Parameter(torch.empty(n_sites, config.d_model))

    def reset_parameters(self) -> None:
        if hasattr(self, "query"):
            nn.init.zeros_(self.query)
            nn.init.ones_(self.key_norm)

    def start(self, embedding: Tensor) -> Stream:
        return (routing_source(embedding),)

    def site_query(self, sites: int | slice) -> RouteQuery:
        """The queries and key-norm gains of site(s) `sites`, as the routing functions take them."""
        return RouteQuery(self.query[sites], self.key_norm[sites], self.heads, KEY_NORM_EPS)

    def record_route(self, sources: Stream, l: int, **scalars: Tensor) -> None:
        """Record sublayer `l`'s depth weights over `sources` with the attached capture, if any."""
        if self.capture is None:
            return
        with torch.no_grad():
            route = self.site_query(self.site(l))
            weights = depth_weights(sources, route)
            normed = (
                v.float() * torch.rsqrt(v.float().square().mean(-1, keepdim=True) + KEY_NORM_EPS) for v in sources
            )
            keys = torch.stack([v.flatten(0, -2).mean(0) for v in normed])  # token means, one source at a time
            self.record(l, weights, keys, route.folded(), **scalars)

    def query_weights(self, query: Tensor, keys: Tensor) -> Tensor:
        """Each head's softmax over depth of its chunk of `query` (key gain folded in) against `keys` [sources, d]."""
        chunks = query.float().view(self.heads, -1)
        return torch.softmax(torch.einsum("nhc,hc->hn", keys.view(keys.shape[0], self.heads, -1), chunks), dim=-1)

    def route(self, sources: Stream, l: int) -> Tensor:
        """Mix `sources` with the query of sublayer `l` (l = n_sublayers is the final read)."""
        self.record_route(sources, l)
        return depth_route(sources, self.site_query(self.site(l)))

    def route_shared(
        self, sources: Stream, l: int, counts: tuple[int, ...]
    ) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        """The mixes [..., d] and log-sum-exps of sublayers l .. l + Q - 1 in one pass over `sources`, sublayer l + k
        reading the first counts[k]; `merge` then adds a source that did not exist yet."""
        route = self.site_query(slice(self.site(l), self.site(l) + len(counts)))
        return depth_route_lse(sources, route, counts=counts)

    def merge(self, mix: Tensor, lse: Tensor, source: Tensor, l: int, norm: RMSNorm | None = None) -> Tensor:
        """Sublayer `l`'s route over the shared sources of `mix` and `lse` plus `source` (exact); with `norm`, normed
        by it, the two differentiated by one fused kernel on the Triton backend."""
        route = self.site_query(self.site(l))
        if norm is None:
            return merge_source(mix, lse, source, route)
        return merge_norm(mix, lse, source, route, weight=norm.weight, norm_eps=norm.eps)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, {super().extra_repr()}"


@register_residual("mhar")
class MHAR(DepthRouter):
    """Multi-head attention residuals: each of `heads` chunks of d gets its own softmax over depth.

    `blocks=None` routes over every earlier sublayer output (full); `blocks=N` groups the L sublayers into
    N blocks of ceil(L / N) and routes over [embedding, finished block sums, in-block partial sum].

    The two sublayers of a transformer block differ only in their last source (the MLP's includes the
    attention output), so `enter` routes both in one pass: the attention read over the whole stream, the MLP
    read over all but the in-block partial sum, which it merges through the log-sum-exp once the attention
    output is added. Every source is read once and its gradient written once per transformer block. A merged read
    and its pre-norm share one fused backward (`read_normed`); a subclass that changes `read` changes `read_normed`
    with it.
    Inside a block the stream is (attention mix, MLP mix, MLP log-sum-exp, *sources): the route returns each mix as
    a tensor of its own, so their gradients reach its backward as they are, without a concatenation.
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

    def enter(self, stream: Stream, l: int) -> Stream:
        n = len(stream)
        counts = (n, n) if l % self.block_len == 0 else (n, n - 1)  # a block start has no partial sum yet
        mixes, lses = self.route_shared(stream, l, counts)
        return (*mixes, lses[1], *stream)

    def read(self, stream: Stream, l: int) -> Tensor:
        if l == self.n_sublayers:  # the final read: one query over the whole stream
            return self.route(stream, l)
        mix_attn, mix_mlp, lse_mlp, *sources = stream
        self.record_route(sources, l)
        if self.site(l) == 0:
            return mix_attn
        return self.merge(mix_mlp, lse_mlp, sources[-1], l)

    def read_normed(self, stream: Stream, l: int, norm: nn.Module) -> Tensor:
        if l == self.n_sublayers or self.site(l) == 0 or not isinstance(norm, RMSNorm):
            return norm(self.read(stream, l))
        _, mix_mlp, lse_mlp, *sources = stream
        self.record_route(sources, l)
        return self.merge(mix_mlp, lse_mlp, sources[-1], l, norm)

    def source_labels(self) -> tuple[str, ...]:
        """Full routing: `emb, attn 0, mlp 0, ...`; block routing: `emb, block 1 .. block N, partial`."""
        n = self.n_sublayers
        if self.block_len == 1:
            return ("emb", *(sublayer_label(i, n) for i in range(n)))
        return ("emb", *(f"block {b}" for b in range(1, math.ceil(n / self.block_len) + 1)), "partial")

    def site_sources(self, l: int) -> tuple[int, ...]:
        """The embedding, the finished blocks and (past a block's first sublayer) the partial sum of l's block."""
        if self.block_len == 1:
            return tuple(range(l + 1))
        partial = (len(self.source_labels()) - 1,) if l % self.block_len else ()
        return (*range(l // self.block_len + 1), *partial)

    def write(self, stream: Stream, l: int, y: Tensor) -> Stream:
        mix_attn, mix_mlp, lse_mlp, *sources = stream
        sources = (*sources, y) if l % self.block_len == 0 else (*sources[:-1], sources[-1] + y)
        return (mix_attn, mix_mlp, lse_mlp, *sources) if self.site(l) == 0 else sources

    def extra_repr(self) -> str:
        return f"blocks={self.blocks}, {super().extra_repr()}"


@register_residual("attnres")
class AttnRes(MHAR):
    """Kimi's Attention Residuals: MHAR with a single head."""

    def __init__(self, blocks: int | None = None) -> None:
        super().__init__(heads=1, blocks=blocks)
