"""The decoder's pieces against naive fp64 formulas (complex-number RoPE, explicit GQA attention)."""

import math

import pytest
import torch

from mhar_lightning.config import ModelConfig
from mhar_lightning.model import Attention, Decoder, RMSNorm, apply_rope, rope_cache


def complex_rope(x, theta):
    """RoPE as rotation of (x_i, x_{i+half}) pairs by complex multiplication."""
    t, hd = x.shape[-2], x.shape[-1]
    half = hd // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float64) / half)
    phase = torch.polar(
        torch.ones(t, half, dtype=torch.float64), torch.outer(torch.arange(t, dtype=torch.float64), freqs)
    )
    z = torch.complex(x[..., :half], x[..., half:]) * phase
    return torch.cat([z.real, z.imag], dim=-1)


def test_rope_matches_complex_rotation():
    config = ModelConfig.preset("tiny")
    x = torch.randn(2, 4, 10, config.head_dim, dtype=torch.float64)
    cos, sin = rope_cache(config, 10, torch.device("cpu"))
    torch.testing.assert_close(
        apply_rope(x, (cos.double(), sin.double())), complex_rope(x, config.rope_theta), rtol=1e-6, atol=1e-6
    )


def test_attention_matches_explicit_gqa_softmax():
    config = ModelConfig.preset("tiny")
    attn = Attention(config).double()
    x = torch.randn(2, 7, config.d_model, dtype=torch.float64)
    cos, sin = rope_cache(config, 7, torch.device("cpu"))
    out = attn(x, (cos.double(), sin.double()))

    hd, group = config.head_dim, config.n_heads // config.n_kv_heads
    q = complex_rope(attn.q(x).view(2, 7, config.n_heads, hd).transpose(1, 2), config.rope_theta)
    k = complex_rope(attn.k(x).view(2, 7, config.n_kv_heads, hd).transpose(1, 2), config.rope_theta)
    v = attn.v(x).view(2, 7, config.n_kv_heads, hd).transpose(1, 2)
    heads = []
    for h in range(config.n_heads):
        scores = q[:, h] @ k[:, h // group].transpose(-1, -2) / math.sqrt(hd)
        scores = scores.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
        heads.append(scores.softmax(-1) @ v[:, h // group])
    expected = attn.o(torch.stack(heads, dim=2).reshape(2, 7, -1))
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_rmsnorm_matches_formula():
    norm = RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 16)
    torch.testing.assert_close(norm(x), x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight)


def test_tied_and_untied_heads():
    tied = Decoder(ModelConfig.preset("tiny"))
    assert tied.head.weight is tied.embed.weight
    untied = Decoder(ModelConfig.preset("tiny", tie_embeddings=False))
    assert untied.head.weight is not untied.embed.weight


def test_meta_construction_then_init_on_cpu():
    config = ModelConfig.preset("tiny")
    with torch.device("meta"):
        model = Decoder(config, "mhar")
    model.to_empty(device="cpu")
    model.init_weights()
    assert all(p.isfinite().all() for p in model.parameters())
    assert model.blocks[0].residual.query.abs().sum() == 0
    assert model(torch.randint(0, 256, (1, 8))).shape == (1, 8, 256)


def test_too_long_sequence_is_refused():
    model = Decoder(ModelConfig.preset("tiny", max_seq_len=8))
    with pytest.raises(ValueError, match="sequence length 9 exceeds max_seq_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))
