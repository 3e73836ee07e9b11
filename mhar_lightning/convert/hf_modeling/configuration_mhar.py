"""Configuration of a decoder exported by mhar-lightning: a Llama-style shape plus its residual strategy.

Self-contained (needs only `transformers`), so an exported directory loads without mhar-lightning installed.
"""

from transformers import PretrainedConfig

STRATEGIES = ("sum", "attnres", "mhar", "delta-mhar")


class MharConfig(PretrainedConfig):
    """`residual` names the strategy; `residual_args` holds its arguments (`heads`, `blocks`, `block_size`)."""

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
        self.head_dim = hidden_size // num_attention_heads
        self.intermediate_size = intermediate_size
        self.rope_base = rope_base
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.residual = residual
        self.residual_args = dict(residual_args or {})
        self.use_cache = use_cache
        kwargs.setdefault("tie_word_embeddings", False)  # the head is stored as its own tensor
        super().__init__(**kwargs)
