"""Export models to Hugging Face directories: `sum` as `LlamaForCausalLM`, routed strategies with their own code."""

import json
from pathlib import Path

import torch

from mhar_lightning.config import ModelConfig
from mhar_lightning.convert.checkpoint import converted_state_dict, read_converted_config, residual_spec
from mhar_lightning.convert.hf_llama import TOKEN_KEYS, hf_names, model_config_to_hf_config
from mhar_lightning.convert.hf_routed import export_routed
from mhar_lightning.convert.hf_tokenizer import save_hf_tokenizer, token_ids
from mhar_lightning.convert.safetensors_io import (
    DEFAULT_SHARD_SIZE,
    TensorEntry,
    fresh_dir,
    parse_size,
    write_sharded,
)
from mhar_lightning.model import Decoder
from mhar_lightning.tokenizer import Tokenizer


def export_hf(
    model_or_dir: Decoder | str | Path,
    out_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: str | int = DEFAULT_SHARD_SIZE,
    tokenizer: Tokenizer | None = None,
) -> Path:
    """Write a Hugging Face directory for a `Decoder` or converted checkpoint: `LlamaForCausalLM` for `sum`, the
    kit's own `MharForCausalLM` (loaded with `trust_remote_code=True`, see `hf_routed`) for routed strategies; with
    `tokenizer`, its files too (see `hf_tokenizer`).

    A converted checkpoint streams (one output shard resident) and keeps its source's token ids; an
    in-memory `Decoder` must hold full (not FSDP-sharded) parameters. `dtype` defaults to the weights'.
    """
    if isinstance(model_or_dir, Decoder):
        config, tokens, spec = model_or_dir.config, {}, residual_spec(model_or_dir.final_residual)
        tensors = dict(model_or_dir.named_parameters())
    else:
        meta = read_converted_config(model_or_dir)
        config, spec = ModelConfig(**meta["model"]), meta["residual"]
        tokens = meta.get("source", {}).get("hf_config", {})
        tensors = converted_state_dict(model_or_dir)
    tokens = {key: tokens[key] for key in TOKEN_KEYS if key in tokens}
    if tokenizer is not None:
        tokens = {**tokens, **token_ids(tokenizer)}
    out = fresh_dir(out_dir)
    if spec["name"] != "sum":
        export_routed(config, spec, tensors, out, dtype, max_shard_size, tokens)
    else:
        entries = [
            TensorEntry(hf, tuple(tensors[ours].shape), dtype or tensors[ours].dtype, tensors[ours].detach)
            for ours, hf in hf_names(config).items()
        ]
        write_sharded(out, entries, parse_size(max_shard_size))
        hf_config = model_config_to_hf_config(config, entries[0].dtype, tokens)
        (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    if tokenizer is not None:
        save_hf_tokenizer(tokenizer, out)
    return out
