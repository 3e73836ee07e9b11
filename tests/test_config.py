"""Model presets and size helpers against published model sizes."""

import pytest

from mhar_lightning.config import PRESETS, ModelConfig


def test_llama3_8b_parameter_count_matches_the_published_model():
    cfg = ModelConfig.preset("llama3-8b")
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_hidden) == (4096, 32, 32, 8, 14336)
    assert (cfg.vocab_size, cfg.rope_theta, cfg.tie_embeddings) == (128256, 500000.0, False)
    assert cfg.num_params() == 8_030_261_248  # Meta-Llama-3-8B's safetensors hold exactly this many


def test_presets_grow_and_flops_follow_6n():
    sizes = [PRESETS[name].num_params() for name in ("tiny", "100m", "350m", "1b")]
    assert sizes == sorted(sizes)
    cfg = PRESETS["1b"]
    dense = cfg.num_params() - cfg.vocab_size * cfg.d_model - cfg.d_model - 2 * cfg.n_layers * cfg.d_model
    assert cfg.flops_per_token(0) == 6 * dense
    assert cfg.flops_per_token(2048) - cfg.flops_per_token(1024) == 12 * cfg.n_layers * cfg.d_model * 1024


def test_preset_overrides_and_errors():
    assert ModelConfig.preset("tiny", n_layers=6).n_layers == 6
    with pytest.raises(ValueError, match="unknown model preset '2b'"):
        ModelConfig.preset("2b")
    with pytest.raises(ValueError, match="n_kv_heads=3 must divide n_heads=4"):
        ModelConfig(n_kv_heads=3)
    with pytest.raises(ValueError, match="n_heads=5 must divide d_model=64"):
        ModelConfig(n_heads=5)
    with pytest.raises(ValueError, match="ModelConfig has no field 'n_layer'; valid fields: vocab_size, d_model, "):
        ModelConfig.preset("tiny", n_layer=6)


def test_llama_variant_fields_round_trip_and_count_their_parameters():
    from mhar_lightning.model import Decoder

    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_seq_len": 64}
    cfg = ModelConfig(head_size=32, rope_scaling=scaling, attention_bias=True, mlp_bias=True, tie_embeddings=False)
    assert cfg.head_dim == 32 and cfg.rope_scaling.factor == 8.0
    assert ModelConfig(**cfg.to_dict()) == cfg  # the JSON form (rope_scaling as a mapping) rebuilds the same config
    assert sum(p.numel() for p in Decoder(cfg).parameters()) == cfg.num_params()
    assert PRESETS["tiny"].head_dim == 16 and PRESETS["tiny"].to_dict()["head_size"] is None
    with pytest.raises(ValueError, match="low_freq_factor < high_freq_factor"):
        ModelConfig(rope_scaling={**scaling, "low_freq_factor": 4.0})
