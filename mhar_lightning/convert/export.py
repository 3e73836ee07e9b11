"""Export `sum` models to a Hugging Face `LlamaForCausalLM` directory (config.json + safetensors)."""

import json
from pathlib import Path

import torch

from mhar_lightning.config import ModelConfig
from mhar_lightning.convert.checkpoint import converted_residual, converted_state_dict, read_converted_config
from mhar_lightning.convert.hf_llama import hf_names, model_config_to_hf_config
from mhar_lightning.convert.safetensors_io import (
    DEFAULT_SHARD_SIZE,
    ConversionError,
    TensorEntry,
    fresh_dir,
    parse_size,
    write_sharded,
)
from mhar_lightning.model import Decoder
from mhar_lightning.residual import Residual, SumResidual

ROUTED_MESSAGE = "only `sum` models export: {} routing has no Hugging Face Llama equivalent"


def export_hf(
    model_or_dir: Decoder | str | Path,
    out_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: str | int = DEFAULT_SHARD_SIZE,
) -> Path:
    """Write `LlamaForCausalLM`-loadable `config.json` + safetensors for a `sum` `Decoder` or converted checkpoint.

    A converted checkpoint streams (one output shard resident) and keeps its source's token ids; an
    in-memory `Decoder` must hold full (not FSDP-sharded) parameters. `dtype` defaults to the weights'.
    """
    if isinstance(model_or_dir, Decoder):
        routed = [type(m).__name__ for m in model_or_dir.modules() if isinstance(m, Residual)]
        if any(name != SumResidual.__name__ for name in routed):
            raise ConversionError(ROUTED_MESSAGE.format(routed[-1]))
        config, tokens = model_or_dir.config, {}
        tensors = dict(model_or_dir.named_parameters())
    else:
        meta = read_converted_config(model_or_dir)
        residual = converted_residual(meta)
        if not isinstance(residual, SumResidual):
            raise ConversionError(ROUTED_MESSAGE.format(type(residual).__name__))
        config, tokens = ModelConfig(**meta["model"]), meta.get("source", {}).get("hf_config", {})
        tensors = converted_state_dict(model_or_dir)
    entries = [
        TensorEntry(hf, tuple(tensors[ours].shape), dtype or tensors[ours].dtype, tensors[ours].detach)
        for ours, hf in hf_names(config).items()
    ]
    out = fresh_dir(out_dir)
    write_sharded(out, entries, parse_size(max_shard_size))
    hf_config = model_config_to_hf_config(config, entries[0].dtype, tokens)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    return out
