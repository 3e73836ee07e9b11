"""A Llama-style decoder whose residual connection is delegated to a `Residual` plugin."""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mhar_lightning.config import ModelConfig
from mhar_lightning.kv_cache import KVCache
from mhar_lightning.norm import RMSNorm
from mhar_lightning.residual import Residual, Stream, make_residual

Rope = tuple[Tensor, Tensor]


def rope_frequencies(config: ModelConfig, device: torch.device) -> Tensor:
    """The head_dim / 2 rotary frequencies, with Llama 3.1's scaling when `config.rope_scaling` is set."""
    half = config.head_dim // 2
    inv_freq = config.rope_theta ** (-torch.arange(half, device=device, dtype=torch.float32) / half)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    # 1 keeps a frequency (short wavelengths), 0 divides it by `factor` (long ones), linear in 1/wavelength between.
    periods = scaling.original_max_seq_len * inv_freq / (2 * math.pi)
    keep = ((periods - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)).clamp(0, 1)
    return (1 - keep) * inv_freq / scaling.factor + keep * inv_freq


def rope_cache(config: ModelConfig, seq_len: int, device: torch.device) -> Rope:
    """cos and sin tables [seq_len, head_dim] for rotary embeddings (half-split layout, as in Llama)."""
    inv_freq = rope_frequencies(config, device)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, rope: Rope) -> Tensor:
    """Rotate `x` [B, heads, T, head_dim] by position."""
    cos, sin = rope
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).type_as(x)


class Attention(nn.Module):
    """Causal multi-head attention with grouped KV heads and RoPE."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        q_dim, kv_dim, bias = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, config.attention_bias
        self.q = nn.Linear(config.d_model, q_dim, bias=bias)
        self.k = nn.Linear(config.d_model, kv_dim, bias=bias)
        self.v = nn.Linear(config.d_model, kv_dim, bias=bias)
        self.o = nn.Linear(q_dim, config.d_model, bias=bias)

    def forward(self, x: Tensor, rope: Rope, cache: KVCache | None = None, layer: int = 0) -> Tensor:
        """Attend from `x`'s positions to themselves and, with a `cache`, to every earlier position (`layer`'s)."""
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        mask = None
        if cache is not None:
            k, v = cache.update(layer, k, v)
            if cache.length:  # query i sits at position length + i: a causal mask offset by the cached positions
                mask = torch.ones(t, k.shape[2], dtype=torch.bool, device=x.device).tril(cache.length)
        gqa = self.n_kv_heads != self.n_heads
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(config.d_model, config.ffn_hidden, bias=config.mlp_bias)
        self.up = nn.Linear(config.d_model, config.ffn_hidden, bias=config.mlp_bias)
        self.down = nn.Linear(config.ffn_hidden, config.d_model, bias=config.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """One transformer block: an attention and an MLP sublayer, each with its own pre-norm.

    `residual` is this block's router; the block only asks it for sublayer inputs and hands it outputs.
    """

    def __init__(self, config: ModelConfig, index: int, residual: Residual) -> None:
        super().__init__()
        self.index = index
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = MLP(config)
        self.residual = residual.spawn(config, range(2 * index, 2 * index + 2))

    def forward(self, stream: Stream, rope: Rope, cache: KVCache | None = None) -> Stream:
        l = 2 * self.index
        stream = self.residual.enter(stream, l)
        y = self.attn(self.residual.read_normed(stream, l, self.attn_norm), rope, cache, self.index)
        stream = self.residual.write(stream, l, y)
        y = self.mlp(self.residual.read_normed(stream, l + 1, self.mlp_norm))
        return self.residual.write(stream, l + 1, y)


class Decoder(nn.Module):
    """Token embedding, `n_layers` blocks, final RMSNorm and LM head; the residual strategy is a plugin."""

    def __init__(self, config: ModelConfig, residual: Residual | str = "sum") -> None:
        super().__init__()
        self.config = config
        template = make_residual(residual)
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config, i, template) for i in range(config.n_layers))
        self.final_residual = template.spawn(config, range(config.n_sublayers, config.n_sublayers + 1))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter (also after materialising a meta-device model shard by shard)."""
        std = self.config.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, (RMSNorm, Residual)):
                module.reset_parameters()
        out_std = std / (2 * self.config.n_layers) ** 0.5
        for block in self.blocks:
            nn.init.normal_(block.attn.o.weight, std=out_std)
            nn.init.normal_(block.mlp.down.weight, std=out_std)

    def hidden(self, tokens: Tensor, cache: KVCache | None = None) -> Tensor:
        """Final-normed hidden states [B, T, d] for `tokens` [B, T], which follow the `cache`'s positions if given."""
        b, t = tokens.shape
        past = 0 if cache is None else cache.length
        if past + t > self.config.max_seq_len:
            raise ValueError(f"sequence length {past + t} exceeds max_seq_len={self.config.max_seq_len}")
        cos, sin = rope_cache(self.config, past + t, tokens.device)
        rope = (cos[past:], sin[past:])
        stream = self.final_residual.start(self.embed(tokens))
        for block in self.blocks:
            stream = block(stream, rope) if cache is None else block(stream, rope, cache)
        if cache is not None:
            cache.advance(t)
        return self.norm(self.final_residual.finish(stream))

    def forward(self, tokens: Tensor, cache: KVCache | None = None) -> Tensor:
        """Logits [B, T, vocab] for `tokens` [B, T] (the positions after the `cache`'s, with one)."""
        return self.head(self.hidden(tokens, cache))
