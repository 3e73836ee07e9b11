"""Model shape: a typed config with named size presets and analytic size helpers."""

from dataclasses import asdict, dataclass, replace


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

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads={self.n_heads} must divide d_model={self.d_model}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(f"head size d_model/n_heads={self.d_model // self.n_heads} must be even for RoPE")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")

    @classmethod
    def preset(cls, name: str, **overrides) -> "ModelConfig":
        """A named size (`tiny`, `100m`, `350m`, `1b`, `llama3-8b`) with optional field overrides."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
        return replace(PRESETS[name], **overrides)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def n_sublayers(self) -> int:
        """Attention and MLP sublayers: the routing depth L = 2 * n_layers."""
        return 2 * self.n_layers

    def block_params(self) -> int:
        """Parameters of one transformer block (attention, MLP and their two norms)."""
        d, kv = self.d_model, self.n_kv_heads * self.head_dim
        return 2 * d * d + 2 * d * kv + 3 * d * self.ffn_hidden + 2 * d

    def num_params(self) -> int:
        """Decoder parameters, residual routing excluded."""
        embed = self.vocab_size * self.d_model
        head = 0 if self.tie_embeddings else embed
        return embed + head + self.n_layers * self.block_params() + self.d_model

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (forward + backward): 6 * matmul params + 12 * layers * d * seq_len.

        The first term counts every weight matmul (the LM head included, the embedding lookup not);
        the second is causal-agnostic attention (QK^T and AV), as in the PaLM and Chinchilla papers.
        """
        seq_len = self.max_seq_len if seq_len is None else seq_len
        matmul = self.n_layers * (self.block_params() - 2 * self.d_model) + self.vocab_size * self.d_model
        return 6 * matmul + 12 * self.n_layers * self.d_model * seq_len

    def to_dict(self) -> dict:
        return asdict(self)


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
