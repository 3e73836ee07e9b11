"""Small decoders of every strategy with every parameter random (routing too, so routing is really exercised)."""

from dataclasses import replace
from pathlib import Path

import torch

from mhar_lightning.config import ModelConfig, RopeScaling
from mhar_lightning.model import Decoder
from mhar_lightning.residual import make_residual

STRATEGIES = {
    "sum": ("sum", {}),
    "attnres-block": ("attnres", {"blocks": 2}),
    "mhar-full": ("mhar", {"heads": 4}),
    "mhar-block": ("mhar", {"heads": 4, "blocks": 3}),
    "delta-mhar": ("delta-mhar", {"heads": 2, "block_size": 1}),
    "hc-static": ("hyper-connections", {"rate": 3, "dynamic": False}),
    "hc-dynamic": ("hyper-connections", {"rate": 2}),
}
CONFIG = ModelConfig(vocab_size=256, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=64)
CONVERTED_SHAPE = replace(
    CONFIG,
    head_size=12,
    rope_scaling=RopeScaling(factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=16),
    attention_bias=True,
    mlp_bias=True,
    tie_embeddings=False,
)
"""Every field that Hugging Face conversion accepts: a separate head size, Llama 3.1 RoPE scaling, biases, untied."""


def random_decoder(strategy: str, seed: int = 0, config: ModelConfig = CONFIG) -> Decoder:
    """A `Decoder` of `strategy` whose parameters, routing queries, gains, gates and null included, are all random."""
    name, args = STRATEGIES[strategy]
    torch.manual_seed(seed)
    model = Decoder(config, make_residual(name, **args))
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            scale = 0.3 if "residual" in param_name else 0.1
            param.add_(torch.randn_like(param) * scale)
    return model.eval()


DOCUMENTS = [
    "The quick brown fox jumps over the lazy dog. " * 6,
    "Depth routing reads earlier sublayer outputs through a softmax over depth. " * 4,
    "def add(a, b):\n    return a + b\n" * 8,
    "Residual streams carry the sum of every sublayer's output. " * 5,
]


def tiny_corpus(root: Path) -> Path:
    """A prepared byte-token folder of a few short documents with a validation split."""
    from mhar_lightning.data.prepare import prepare_files
    from mhar_lightning.data.tokenizer import load_tokenizer

    sources = []
    for i, text in enumerate(DOCUMENTS * 3):
        sources.append(root / "text" / f"doc{i}.txt")
        sources[-1].parent.mkdir(parents=True, exist_ok=True)
        sources[-1].write_text(f"{i}: {text}")
    out = root / "prepared"
    prepare_files(sources, out, load_tokenizer("byte"), val_fraction=0.3, progress=False)
    return out


def trained_checkpoint(root: Path, residual: str = "mhar", *overrides: str) -> tuple[Path, Path]:
    """A two-step `mhar fit` of the demo recipe on `tiny_corpus` with `residual`: (last.ckpt, prepared folder)."""
    from cli_helpers import NO_PROBES, fast_demo_args

    from mhar_lightning.cli import main as mhar

    data = tiny_corpus(root)
    args = [*fast_demo_args(root, 2), *NO_PROBES, "--data.path", str(data), "--model.residual", residual, *overrides]
    try:
        mhar([*args, "--data.seq_len", "16", "--checkpoint.every_n_train_steps", "2"])
    except SystemExit as exit_:
        assert not exit_.code, f"mhar fit exited with {exit_.code}"
    return root / "checkpoints" / "last.ckpt", data
