"""Configuration of a decoder exported by mhar-lightning: a Llama-style shape plus its residual strategy.

Self-contained (needs only `transformers`), so an exported directory loads without mhar-lightning installed.
"""

from transformers import PretrainedConfig

STRATEGIES = ("sum", "attnres", "mhar", "delta-mhar", "hyper-connections")


class MharConfig(PretrainedConfig):
    """`residual` names the strategy; `residual_args` holds its arguments (`heads`, `blocks`, `block_size`, `rate`,
    `dynamic`). `head_dim` defaults to hidden_size // num_attention_heads; `rope_llama3` holds Llama 3.1's RoPE
    scaling (`factor`, `low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings`) or None."""

    model_type = "mhar"

    def __init__(
        self,
        vocab_size: int = 256,
        hidden_size: int = 64,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        intermediate_size: int = 176,
        rope_base: float = 10000.0,
        max_position_embeddings: int = 256,
        rms_norm_eps: float = 1e-5,
        head_dim: int | None = None,
        rope_llama3: dict | None = None,
        attention_bias: bool = False,
        mlp_bias: bool = False,
        residual: str = "sum",
        residual_args: dict | None = None,
        use_cache: bool = True,
        **kwargs,
    ) -> None:
        if residual not in STRATEGIES:
            raise ValueError(f"unknown residual strategy {residual!r}; this file implements {', '.join(STRATEGIES)}")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.intermediate_size = intermediate_size
        self.rope_base = rope_base
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_llama3 = dict(rope_llama3) if rope_llama3 else None
        self.attention_bias = attention_bias
        self.mlp_bias = mlp_bias
        self.residual = residual
        self.residual_args = dict(residual_args or {})
        self.use_cache = use_cache
        kwargs.setdefault("tie_word_embeddings", False)  # the head is stored as its own tensor
        super().__init__(**kwargs)
