"""Export `mhar`, `attnres`, `delta-mhar` and `hyper-connections` models as Hugging Face directories with their own
modeling code.

The directory holds `config.json` (`model_type: mhar`, an `auto_map` to the shipped code), the weights under the
`Decoder`'s own parameter names, and `configuration_mhar.py` + `modeling_mhar.py` (plain PyTorch, copied from
`hf_modeling/`), so `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` loads it without this kit.
"""

import dataclasses
import json
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from mhar_lightning.config import ModelConfig
from mhar_lightning.convert.hf_llama import llama3_rope_parameters
from mhar_lightning.convert.safetensors_io import ConversionError, TensorEntry, parse_size, write_sharded

CODE_DIR = Path(__file__).parent / "hf_modeling"
CODE_FILES = ("configuration_mhar.py", "modeling_mhar.py")
ROUTED = ("mhar", "attnres", "delta-mhar", "hyper-connections")
EXPORTED_FIELDS = {
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "ffn_hidden": "intermediate_size",
    "rope_theta": "rope_base",
    "max_seq_len": "max_position_embeddings",
    "norm_eps": "rms_norm_eps",
    "attention_bias": "attention_bias",
    "mlp_bias": "mlp_bias",
}
"""ModelConfig field -> MharConfig key; `head_size` and `rope_scaling` are written by `routed_hf_config`,
`tie_embeddings` and `init_std` need none (the head is stored)."""
HANDLED_FIELDS = (*EXPORTED_FIELDS, "head_size", "rope_scaling", "tie_embeddings", "init_std")


def check_exportable(config: ModelConfig, residual: str) -> None:
    """Refuse a strategy, or a `ModelConfig` field that `routed_hf_config` does not write (one added later)."""
    if residual not in ROUTED:
        raise ConversionError(
            f"residual {residual!r} has no Hugging Face implementation; exportable: sum, {', '.join(ROUTED)}"
        )
    for field in dataclasses.fields(ModelConfig):
        if field.name not in HANDLED_FIELDS and getattr(config, field.name) != field.default:
            raise ConversionError(f"ModelConfig.{field.name}={getattr(config, field.name)!r} does not export yet")


def routed_hf_config(config: ModelConfig, spec: Mapping, dtype: torch.dtype, tokens: Mapping) -> dict:
    """`config.json` of an exported routed model."""
    return {
        "architectures": ["MharForCausalLM"],
        "model_type": "mhar",
        "auto_map": {
            "AutoConfig": "configuration_mhar.MharConfig",
            "AutoModelForCausalLM": "modeling_mhar.MharForCausalLM",
        },
        **{theirs: getattr(config, ours) for ours, theirs in EXPORTED_FIELDS.items()},
        "head_dim": config.head_dim,
        "rope_llama3": llama3_rope_parameters(config.rope_scaling),
        "residual": spec["name"],
        "residual_args": dict(spec["args"]),
        "tie_word_embeddings": False,
        "dtype": str(dtype).removeprefix("torch."),
        **dict(tokens),
    }


def export_routed(
    config: ModelConfig,
    spec: Mapping,
    tensors: Mapping[str, Tensor],
    out: Path,
    dtype: torch.dtype | None,
    max_shard_size: str | int,
    tokens: Mapping,
) -> None:
    """Write the weights (`Decoder` names; a tied head stored as its own tensor), config.json and the code to `out`."""
    check_exportable(config, spec["name"])
    head = tensors.get("head.weight", tensors["embed.weight"])
    entries = [
        TensorEntry(name, tuple(t.shape), dtype or t.dtype, t.detach)
        for name, t in tensors.items()
        if name != "head.weight"
    ]
    entries.append(TensorEntry("head.weight", tuple(head.shape), dtype or head.dtype, lambda: head.detach().clone()))
    write_sharded(out, entries, parse_size(max_shard_size))
    for file in CODE_FILES:
        shutil.copyfile(CODE_DIR / file, out / file)
    hf_config = routed_hf_config(config, spec, entries[0].dtype, tokens)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
