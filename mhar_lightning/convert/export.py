"""Export `sum` models to a Hugging Face `LlamaForCausalLM` directory (config.json + safetensors)."""

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
from mhar_lightning.convert.safetensors_io import (
    DEFAULT_SHARD_SIZE,
    ConversionError,
    TensorEntry,
    fresh_dir,
    parse_size,
    write_sharded,
)
from mhar_lightning.model import Decoder
from mhar_lightning.residual import Residual, SumResidual, make_residual

ROUTED_MESSAGE = "only `sum` models export: {} routing has no Hugging Face Llama equivalent"


def export_hf(
    model_or_dir: Decoder | str | Path,
    out_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: str | int = DEFAULT_SHARD_SIZE,
) -> Path:
    """Write `LlamaForCausalLM`-loadable `config.json` + safetensors for a `sum` `Decoder` or converted checkpoint.

    A converted checkpoint streams (one output shard resident) and keeps its source's token ids and tokenizer files; an
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
    if not isinstance(model_or_dir, Decoder):
        copy_tokenizer_files(model_or_dir, out)
    return out


def export_training_checkpoint(
    ckpt_path: str | Path,
    out_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: str | int = DEFAULT_SHARD_SIZE,
) -> Path:
    """Export a `mhar fit` checkpoint file of a `sum` model (e.g. `last.ckpt`, or a consolidated FSDP one).

    When the run started from a converted model (`model.init_from`), that directory's tokenizer files and the
    source's token ids go along, so the export is the mid-trained version of the original Hugging Face model.
    """
    checkpoint = torch.load(ckpt_path, map_location="cpu", mmap=True, weights_only=True)
    hparams = checkpoint.get("hyper_parameters", {})
    if "model_config" not in hparams:
        raise ConversionError(f"{ckpt_path} records no model_config: pass a checkpoint that `mhar fit` wrote")
    config = ModelConfig(**hparams["model_config"])
    decoder = Decoder(config, make_residual(hparams["residual"]))
    decoder.load_state_dict({k.removeprefix("decoder."): v for k, v in checkpoint["state_dict"].items()})
    out = export_hf(decoder, out_dir, dtype=dtype, max_shard_size=max_shard_size)
    init_from = hparams.get("init_from")
    if init_from is not None and (Path(init_from) / CONFIG_FILE).is_file():
        source = read_converted_config(init_from).get("source", {}).get("hf_config", {})
        hf_config = json.loads((out / "config.json").read_text())
        hf_config |= {key: source[key] for key in TOKEN_KEYS if key in source}
        (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        copy_tokenizer_files(init_from, out)
    return out
