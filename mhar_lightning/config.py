"""Model shape: a typed config with named size presets and analytic size helpers."""

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace

VOCAB_MULTIPLE = 64


def padded_vocab(tokenizer_vocab: int) -> int:
    """Model vocabulary for a tokenizer: rounded up to a multiple of 64 for fast matmuls (50257 -> 50304)."""
    return -(-tokenizer_vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1-style RoPE frequency scaling (`rope_type: llama3` in a Hugging Face config).

    Wavelengths shorter than `original_max_seq_len / high_freq_factor` keep their frequency, those longer than
    `original_max_seq_len / low_freq_factor` are slowed down by `factor`, and the band between is interpolated.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_seq_len: int

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.low_freq_factor >= self.high_freq_factor:
            raise ValueError(
                f"rope_scaling needs factor > 0 and low_freq_factor < high_freq_factor, got factor={self.factor}, "
                f"low_freq_factor={self.low_freq_factor}, high_freq_factor={self.high_freq_factor}"
            )


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-style decoder (pre-RMSNorm, RoPE, GQA attention, SwiGLU MLP)."""

    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 176
    rope_theta: float = 10000.0
    max_seq_len: int = 256
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02
    head_size: int | None = None  # per-head width of q, k and v; None: d_model // n_heads (see `head_dim`)
    rope_scaling: RopeScaling | None = None
    attention_bias: bool = False  # biases on the q, k, v and o projections
    mlp_bias: bool = False  # biases on the gate, up and down projections

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, Mapping):  # from JSON or YAML
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.head_size is None and self.d_model % self.n_heads:
            raise ValueError(f"n_heads={self.n_heads} must divide d_model={self.d_model}")
        if self.head_dim < 1 or self.head_dim % 2:
            raise ValueError(f"head size {self.head_dim} must be positive and even for RoPE")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")

    @classmethod
    def preset(cls, name: str, **overrides) -> "ModelConfig":
        """A named size (`tiny`, `100m`, `350m`, `1b`, `llama3-8b`) with optional field overrides."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
        check_fields(overrides)
        return replace(PRESETS[name], **overrides)

    @property
    def head_dim(self) -> int:
        """Per-head width: `head_size`, or `d_model // n_heads` when unset."""
        return self.head_size or self.d_model // self.n_heads

    @property
    def n_sublayers(self) -> int:
        """Attention and MLP sublayers: the routing depth L = 2 * n_layers."""
        return 2 * self.n_layers

    def block_matmul_params(self) -> int:
        """Weights of one transformer block's projections (q, k, v, o, gate, up, down)."""
        d, q, kv = self.d_model, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return 2 * d * q + 2 * d * kv + 3 * d * self.ffn_hidden

    def block_params(self) -> int:
        """Parameters of one transformer block (attention, MLP, their biases and their two norms)."""
        q, kv, d = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.d_model
        biases = (q + 2 * kv + d) * self.attention_bias + (2 * self.ffn_hidden + d) * self.mlp_bias
        return self.block_matmul_params() + biases + 2 * self.d_model

    def num_params(self) -> int:
        """Decoder parameters, residual routing excluded."""
        embed = self.vocab_size * self.d_model
        head = 0 if self.tie_embeddings else embed
        return embed + head + self.n_layers * self.block_params() + self.d_model

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (forward + backward): 6 * matmul params + 12 * layers * d * seq_len.

        The first term counts every weight matmul (the LM head included, the embedding lookup not);
        the second is causal-agnostic attention (QK^T and AV, of width n_heads * head_dim, which is d in most models),
        as in the PaLM and Chinchilla papers.
        """
        seq_len = self.max_seq_len if seq_len is None else seq_len
        matmul = self.n_layers * self.block_matmul_params() + self.vocab_size * self.d_model
        return 6 * matmul + 12 * self.n_layers * self.n_heads * self.head_dim * seq_len

    def to_dict(self) -> dict:
        return asdict(self)


def check_fields(overrides: Mapping[str, object], source: str = "ModelConfig", config: type | None = None) -> None:
    """Refuse keys that are not fields of the dataclass `config` (default `ModelConfig`), naming the valid ones (a
    typo is otherwise a TypeError)."""
    valid = [field.name for field in fields(config or ModelConfig)]
    unknown = [key for key in overrides if key not in valid]
    if unknown:
        raise ValueError(f"{source} has no field {', '.join(map(repr, unknown))}; valid fields: {', '.join(valid)}")


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(),
    "100m": ModelConfig(
        vocab_size=50304, d_model=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_hidden=2048, max_seq_len=2048
    ),
    "350m": ModelConfig(
        vocab_size=50304, d_model=1024, n_layers=24, n_heads=16, n_kv_heads=4, ffn_hidden=2816, max_seq_len=2048
    ),
    "1b": ModelConfig(
        vocab_size=50304,
        d_model=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=8192,
        max_seq_len=2048,
        tie_embeddings=False,
    ),
    "llama3-8b": ModelConfig(
        vocab_size=128256,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=14336,
        rope_theta=500000.0,
        max_seq_len=8192,
        tie_embeddings=False,
    ),
}
