"""A decoder exported by mhar-lightning, in plain PyTorch for `transformers` (`trust_remote_code=True`).

Self-contained (needs only `torch` and `transformers`), so an exported directory loads without mhar-lightning.
The decoder is Llama-style (pre-RMSNorm, RoPE, grouped-query attention, SwiGLU); what differs is the residual
connection, `config.residual`:

- `mhar` / `attnres`: sublayer l reads a per-head softmax over depth of its sources (the embedding and earlier
  sublayer outputs, or with `blocks` the finished block sums and the current block's partial sum), with a learned
  query and key-RMSNorm gain per site; the final norm reads one more such route (AttnRes is one head).
- `delta-mhar`: sublayer l reads p_l + gate_l * route_l([null, embedding, finished block deltas]), p_{l+1} = p_l + y_l.
- `hyper-connections`: `rate` streams H_j; sublayer l reads x_l = sum_j A_m[j] H_j and writes
  H'_k = B[k] y_l + sum_j A_r[j, k] H_j (static weights plus, when `dynamic`, tanh terms of each normalised stream);
  the final norm reads the mean of the streams.

Routing mixes the streams of one token at a time, so cached decoding keeps attention keys and values only.
Parameter names are those of mhar-lightning's `Decoder`, so its state dict loads as it is.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_mhar import MharConfig

KEY_NORM_EPS = 1e-6
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def unit_rms(x: Tensor, eps: float) -> Tensor:
    """x / RMS(x) over the last dimension, statistics in at least fp32, in x's dtype."""
    stats = x.to(torch.promote_types(x.dtype, torch.float32))
    return (stats * torch.rsqrt(stats.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


def weighted_sum(weights: Tensor, streams: list[Tensor]) -> Tensor:
    """sum_j weights[..., j] * streams[j]."""
    out = weights[..., 0, None] * streams[0]
    for j in range(1, len(streams)):
        out = out + weights[..., j, None] * streams[j]
    return out


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)).type_as(x)


def depth_route(sources: list[Tensor], query: Tensor, key_norm: Tensor, heads: int) -> Tensor:
    """sum_n softmax_n(query[h] . RMSNorm_g(v_n)[h]) * v_n[h] per head h: the mix of `sources` [..., d]."""
    d = query.shape[-1]
    u = (query.float() * key_norm.float()).view(heads, d // heads)
    logits = torch.stack(
        [
            (v.unflatten(-1, (heads, d // heads)) * u).sum(-1)
            * torch.rsqrt(v.float().square().mean(-1, True) + KEY_NORM_EPS)
            for v in sources
        ],
        dim=-1,
    )
    weights = logits.softmax(-1)
    mix = sum(weights[..., n, None] * v.unflatten(-1, (heads, d // heads)) for n, v in enumerate(sources))
    return mix.flatten(-2).to(sources[0].dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat([-x2, x1], dim=-1) * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, config: MharConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.heads, self.kv_heads, self.head_dim = (
            layer,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        d, bias = config.hidden_size, config.attention_bias
        q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        self.q = nn.Linear(d, q, bias=bias)
        self.k = nn.Linear(d, kv, bias=bias)
        self.v = nn.Linear(d, kv, bias=bias)
        self.o = nn.Linear(q, d, bias=bias)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor | None, cache) -> Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, *rope), rotate(k, *rope)
        if cache is not None:
            k, v = cache.update(k, v, self.layer)
        gqa = self.kv_heads != self.heads
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, config: MharConfig) -> None:
        super().__init__()
        d, ffn, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate = nn.Linear(d, ffn, bias=bias)
        self.up = nn.Linear(d, ffn, bias=bias)
        self.down = nn.Linear(ffn, d, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Router(nn.Module):
    """The routing parameters of `n_sites` sites (a block's two sublayers, or the final read)."""

    def __init__(self, config: MharConfig, n_sites: int, final: bool) -> None:
        super().__init__()
        d = config.hidden_size
        if config.residual == "hyper-connections":
            if not final:  # the final read is the mean of the streams
                self.add_hyper_parameters(config, n_sites)
            return
        if config.residual == "delta-mhar" and final:
            self.null = nn.Parameter(torch.zeros(d))
            return
        self.query = nn.Parameter(torch.zeros(n_sites, d))
        self.key_norm = nn.Parameter(torch.ones(n_sites, d))
        if config.residual == "delta-mhar":
            self.gate = nn.Parameter(torch.zeros(n_sites))

    def add_hyper_parameters(self, config: MharConfig, n_sites: int) -> None:
        """Static weights as offsets from the Pre-Norm residual; `dynamic_proj` columns: A_m, A_r row, B."""
        n = config.residual_args.get("rate", 4)
        self.read_offset = nn.Parameter(torch.zeros(n_sites, n))
        self.mix_offset = nn.Parameter(torch.zeros(n_sites, n, n))
        self.write_offset = nn.Parameter(torch.zeros(n_sites, n))
        if config.residual_args.get("dynamic", True):
            self.dynamic_proj = nn.Parameter(torch.zeros(n_sites, config.hidden_size, n + 2))
            self.dynamic_scale = nn.Parameter(torch.full((n_sites, 2), 0.01))


class RoutedStream:
    """MHAR / AttnRes: sources are the embedding, finished block sums and the current block's partial sum."""

    def __init__(self, config: MharConfig, embedding: Tensor, final: Router) -> None:
        args = config.residual_args
        self.heads = 1 if config.residual == "attnres" else args.get("heads", 8)
        blocks, n = args.get("blocks"), 2 * config.num_hidden_layers
        self.block_len = 1 if blocks is None else math.ceil(n / blocks)
        self.sources, self.final = [embedding], final

    def read(self, router: Router, l: int, site: int) -> Tensor:
        return depth_route(self.sources, router.query[site], router.key_norm[site], self.heads)

    def write(self, l: int, y: Tensor) -> None:
        if l % self.block_len == 0:
            self.sources.append(y)
        else:
            self.sources[-1] = self.sources[-1] + y

    def finish(self) -> Tensor:
        return depth_route(self.sources, self.final.query[0], self.final.key_norm[0], self.heads)


class DeltaStream:
    """Delta-MHAR: an untouched sum p plus a gated route over [null, embedding, finished block deltas]."""

    def __init__(self, config: MharConfig, embedding: Tensor, final: Router) -> None:
        self.heads = config.residual_args.get("heads", 8)
        self.block_len = 2 * config.residual_args.get("block_size", 4)
        self.p = self.block_start = embedding
        self.sources = [final.null.to(embedding.dtype).expand_as(embedding), embedding]

    def read(self, router: Router, l: int, site: int) -> Tensor:
        mix = depth_route(self.sources, router.query[site], router.key_norm[site], self.heads)
        return self.p + router.gate[site] * mix

    def write(self, l: int, y: Tensor) -> None:
        self.p = self.p + y
        if (l + 1) % self.block_len == 0:
            self.sources.append((self.p - self.block_start).to(y.dtype))
            self.block_start = self.p

    def finish(self) -> Tensor:
        return self.p


class HyperStream:
    """Hyper-connections: `rate` streams; a read computes its site's read, mix and write weights, used by its write."""

    def __init__(self, config: MharConfig, embedding: Tensor, final: Router) -> None:
        self.rate = config.residual_args.get("rate", 4)
        self.dynamic = config.residual_args.get("dynamic", True)
        self.eps = config.rms_norm_eps
        self.streams = [embedding] * self.rate

    def read(self, router: Router, l: int, site: int) -> Tensor:
        eye = torch.eye(self.rate, device=router.read_offset.device, dtype=router.read_offset.dtype)
        read = eye[l % self.rate] + router.read_offset[site]
        mix, write = eye + router.mix_offset[site], 1 + router.write_offset[site]
        if self.dynamic:
            normed = torch.stack([unit_rms(h, self.eps) for h in self.streams], -2)
            terms = torch.tanh(normed @ router.dynamic_proj[site].to(normed.dtype))
            scale_a, scale_b = router.dynamic_scale[site, 0], router.dynamic_scale[site, 1]
            read, mix = read + scale_a * terms[..., 0], mix + scale_a * terms[..., 1:-1]
            write = write + scale_b * terms[..., -1]
        self.mix, self.write_weights = mix, write
        return weighted_sum(read, self.streams)

    def write(self, l: int, y: Tensor) -> None:
        mix, write = self.mix, self.write_weights
        self.streams = [write[..., k, None] * y + weighted_sum(mix[..., k], self.streams) for k in range(self.rate)]

    def finish(self) -> Tensor:
        h = self.streams[0]
        return weighted_sum(torch.full((self.rate,), 1 / self.rate, device=h.device, dtype=h.dtype), self.streams)


STREAMS = {"mhar": RoutedStream, "attnres": RoutedStream, "delta-mhar": DeltaStream, "hyper-connections": HyperStream}


class Block(nn.Module):
    def __init__(self, config: MharConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, index)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.residual = Router(config, 2, final=False)

    def forward(self, stream, rope: tuple[Tensor, Tensor], mask: Tensor | None, cache) -> None:
        l = 2 * self.index
        stream.write(l, self.attn(self.attn_norm(stream.read(self.residual, l, 0)), rope, mask, cache))
        stream.write(l + 1, self.mlp(self.mlp_norm(stream.read(self.residual, l + 1, 1))))


class MharPreTrainedModel(PreTrainedModel):
    config_class = MharConfig
    base_model_prefix = "mhar"
    _no_split_modules = ["Block"]

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)


class MharForCausalLM(MharPreTrainedModel, GenerationMixin):
    """Embedding, blocks whose residual connection routes over depth, final RMSNorm and LM head."""

    def __init__(self, config: MharConfig) -> None:
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.final_residual = Router(config, 1, final=True)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed

    def get_output_embeddings(self) -> nn.Linear:
        return self.head

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin [B, 1, T, head_dim] of `positions` [B, T] (half-split layout, as in Llama)."""
        half = self.config.head_dim // 2
        inv_freq = self.config.rope_base ** (-torch.arange(half, device=positions.device, dtype=torch.float32) / half)
        scaling = self.config.rope_llama3
        if scaling:  # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, linear in 1/wavelength between
            periods = scaling["original_max_position_embeddings"] * inv_freq / (2 * math.pi)
            low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
            keep = ((periods - low) / (high - low)).clamp(0, 1)
            inv_freq = (1 - keep) * inv_freq / scaling["factor"] + keep * inv_freq
        angles = positions.float()[..., None] * inv_freq
        angles = torch.cat([angles, angles], dim=-1)[:, None]
        return angles.cos(), angles.sin()

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        past_key_values=None,
        use_cache: bool | None = None,
        labels: Tensor | None = None,
        cache=None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache()
        b, t = input_ids.shape
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + t, device=input_ids.device).expand(b, t)
        mask = None
        if past or (attention_mask is not None and not attention_mask.all()):
            key_pos = torch.arange(past + t, device=input_ids.device)
            query_pos = torch.arange(past, past + t, device=input_ids.device)
            mask = key_pos <= query_pos[:, None]
            if attention_mask is not None:  # padding; each token still sees itself, so no row is empty
                mask = (mask & attention_mask[:, None, None, :].bool()) | (key_pos == query_pos[:, None])
        stream = STREAMS[self.config.residual](self.config, self.embed(input_ids), self.final_residual)
        rope = self.rope(position_ids)
        for block in self.blocks:
            block(stream, rope, mask, cache)
        logits = self.head(self.norm(stream.finish()))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache if use_cache else None})
