"""Export models to Hugging Face directories: `sum` as `LlamaForCausalLM`, routed strategies with their own code."""

import json
from pathlib import Path

import torch

from mhar_lightning.config import ModelConfig
from mhar_lightning.convert.checkpoint import (
    CONFIG_FILE,
    converted_residual,
    converted_state_dict,
    read_converted_config,
)
from mhar_lightning.convert.hf_llama import TOKEN_KEYS, copy_tokenizer_files, hf_names, model_config_to_hf_config
from mhar_lightning.convert.hf_routed import export_routed
from mhar_lightning.convert.hf_tokenizer import save_hf_tokenizer, token_ids
from mhar_lightning.convert.safetensors_io import (
    DEFAULT_SHARD_SIZE,
    TensorEntry,
    fresh_dir,
    parse_size,
    write_sharded,
)
from mhar_lightning.data.tokenizer import Tokenizer
from mhar_lightning.model import Decoder
from mhar_lightning.residual import SumResidual, residual_name


def export_hf(
    model_or_dir: Decoder | str | Path,
    out_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: str | int = DEFAULT_SHARD_SIZE,
    tokenizer: Tokenizer | None = None,
) -> Path:
    """Write a Hugging Face directory for a `Decoder` or converted checkpoint: `LlamaForCausalLM` for `sum`, the
    kit's own `MharForCausalLM` (loaded with `trust_remote_code=True`, see `hf_routed`) for routed strategies.

    A converted checkpoint streams (one output shard resident) and keeps its source's token ids and tokenizer files;
    `tokenizer` adds its own files where there are none (see `hf_tokenizer`). An in-memory `Decoder` must hold full
    (not FSDP-sharded) parameters. `dtype` defaults to the weights'.
    """
    max_shard_size = parse_size(max_shard_size)  # a bad size fails before the output directory exists
    if isinstance(model_or_dir, Decoder):
        config, tokens, template = model_or_dir.config, {}, model_or_dir.final_residual
        tensors = dict(model_or_dir.named_parameters())
    else:
        meta = read_converted_config(model_or_dir)
        config, template = ModelConfig(**meta["model"]), converted_residual(meta)
        tokens = meta.get("source", {}).get("hf_config", {})
        tensors = converted_state_dict(model_or_dir)
    tokens = {key: tokens[key] for key in TOKEN_KEYS if key in tokens}
    if tokenizer is not None:
        tokens = {**token_ids(tokenizer), **tokens}
    out = fresh_dir(out_dir)
    if isinstance(template, SumResidual):
        entries = [
            TensorEntry(hf, tuple(tensors[ours].shape), dtype or tensors[ours].dtype, tensors[ours].detach)
            for ours, hf in hf_names(config).items()
        ]
        write_sharded(out, entries, max_shard_size)
        hf_config = model_config_to_hf_config(config, entries[0].dtype, tokens)
        (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    else:
        spec = {"name": residual_name(template), "args": template.spec()["init_args"]}
        export_routed(config, spec, tensors, out, dtype, max_shard_size, tokens)
    if not isinstance(model_or_dir, Decoder):
        copy_tokenizer_files(model_or_dir, out)
    if tokenizer is not None and not (out / "tokenizer.json").exists():
        save_hf_tokenizer(tokenizer, out)
    return out


def export_training_checkpoint(
    model: Decoder,
    init_from: str | Path | None,
    out_dir: str | Path,
    *,
    tokenizer: Tokenizer | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: str | int = DEFAULT_SHARD_SIZE,
) -> Path:
    """Export the decoder of a `mhar fit` checkpoint. When the run started from a converted model (`init_from`),
    that directory's tokenizer files and the source's token ids go along, so the export is the mid-trained version
    of the original Hugging Face model; otherwise `tokenizer` (the run's) is written."""
    if init_from is None or not (Path(init_from) / CONFIG_FILE).is_file():
        return export_hf(model, out_dir, dtype=dtype, max_shard_size=max_shard_size, tokenizer=tokenizer)
    source = read_converted_config(init_from).get("source", {}).get("hf_config", {})  # checked before writing
    out = export_hf(model, out_dir, dtype=dtype, max_shard_size=max_shard_size)
    hf_config = json.loads((out / "config.json").read_text())
    hf_config |= {key: source[key] for key in TOKEN_KEYS if key in source}
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    copy_tokenizer_files(init_from, out)
    return out
