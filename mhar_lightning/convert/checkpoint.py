"""Converted checkpoints: import a Hugging Face Llama into any residual strategy, save it, and load it back.

Models are built on the meta device and filled tensor by tensor from memory-mapped safetensors, so
loading costs one copy of the model and converting to disk costs one output shard.
"""

import inspect
import json
from pathlib import Path

import torch
from torch import Tensor, nn

from mhar_lightning.config import ModelConfig
from mhar_lightning.contained import inside
from mhar_lightning.convert.hf_llama import TOKENIZER_FILES, HFLlamaCheckpoint, copy_tokenizer_files
from mhar_lightning.convert.safetensors_io import (
    DEFAULT_SHARD_SIZE,
    ConversionError,
    SafetensorsDir,
    TensorEntry,
    check_tensors,
    fresh_dir,
    parse_size,
    write_sharded,
)
from mhar_lightning.model import Decoder
from mhar_lightning.residual import RESIDUALS, Residual, make_residual
from mhar_lightning.residual.trust import check_stored_residual

CONFIG_FILE = "mhar_config.json"
FORMAT_VERSION = 1


def init_args(cls: type[Residual]) -> list[str]:
    """Names of the keyword arguments `cls` takes (its hyperparameters)."""
    params = inspect.signature(cls.__init__).parameters.values()
    return [p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def residual_template(residual: str | Residual, **residual_args) -> Residual:
    """`make_residual`, with a clear error when a strategy does not take the given arguments."""
    try:
        return make_residual(residual, **residual_args)
    except TypeError as error:
        takes = init_args(RESIDUALS[residual])
        unknown = [arg for arg in residual_args if arg not in takes]
        if not unknown:  # a known argument of the wrong type
            raise ConversionError(f"residual {residual!r} cannot take {residual_args}: {error}") from error
        raise ConversionError(
            f"residual {residual!r} takes {', '.join(takes) or 'no arguments'}, not {', '.join(unknown)}"
        ) from error


def meta_decoder(config: ModelConfig, template: Residual) -> Decoder:
    """A `Decoder` whose parameters live on the meta device (no memory) until `materialize` fills them."""
    with torch.device("meta"):
        return Decoder(config, template)


def routing_entries(model: Decoder, dtype: torch.dtype) -> list[TensorEntry]:
    """The routing parameters of meta `model`, materialised and initialised by their own `reset_parameters`."""
    entries = []
    for prefix, router in model.named_modules():
        if isinstance(router, Residual):
            router.to_empty(device="cpu")
            router.reset_parameters()
            entries += [
                TensorEntry(f"{prefix}.{name}", tuple(p.shape), dtype, p.detach)
                for name, p in router.named_parameters()
            ]
    return entries


def materialize(model: Decoder, entries: list[TensorEntry]) -> Decoder:
    """Replace the parameters of `model` named by `entries` with their (copied) tensors; re-tie the head."""
    for entry in entries:
        prefix, _, attr = entry.name.rpartition(".")
        module = model.get_submodule(prefix)
        setattr(module, attr, nn.Parameter(entry.load(copy=True), requires_grad=getattr(module, attr).requires_grad))
    if model.config.tie_embeddings:
        model.head.weight = model.embed.weight
    return model


def load_hf_llama(
    path: str | Path, residual: str | Residual = "delta-mhar", *, dtype: torch.dtype | None = None, **residual_args
) -> Decoder:
    """A `Decoder` with the weights of the Hugging Face Llama at `path` and freshly initialised routing.

    `dtype` defaults to the checkpoint's. With zero-initialised routing, `delta-mhar` (and `sum`) compute
    exactly what the source model computes.
    """
    source = HFLlamaCheckpoint(path)
    model = meta_decoder(source.config, residual_template(residual, **residual_args))
    dtype = dtype or source.dtype
    return materialize(model, source.entries(model, dtype) + routing_entries(model, dtype))


def save_converted(
    src_dir: str | Path,
    out_dir: str | Path,
    residual: str | Residual = "delta-mhar",
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: str | int = DEFAULT_SHARD_SIZE,
    **residual_args,
) -> Path:
    """Convert the Hugging Face Llama at `src_dir` into a new converted checkpoint `out_dir` (see the package doc).

    Streams: at most one output shard of tensors is resident. The source's tokenizer files are copied, so the
    directory is all a run needs (`model.init_from` and `data.tokenizer`); `mhar_config.json` is written last, so
    a directory without it is an interrupted conversion.
    """
    shard_bytes = parse_size(max_shard_size)
    source = HFLlamaCheckpoint(src_dir)
    template = residual_template(residual, **residual_args)
    model = meta_decoder(source.config, template)
    dtype = dtype or source.dtype
    entries = source.entries(model, dtype) + routing_entries(model, dtype)
    out = fresh_dir(out_dir)
    write_sharded(out, entries, shard_bytes)
    copy_tokenizer_files(src_dir, out)
    meta = {
        "format_version": FORMAT_VERSION,
        "model": source.config.to_dict(),
        "residual": template.spec(),
        "dtype": str(dtype).removeprefix("torch."),
        "source": {"path": str(Path(src_dir).resolve()), "hf_config": source.hf_config},
    }
    (out / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def read_converted_config(path: str | Path) -> dict:
    """The parsed `mhar_config.json` of converted checkpoint `path`; a residual class it may not name is refused, and
    so is a tokenizer file that links out of `path` (an export would copy what it leads to)."""
    config_file = Path(path) / CONFIG_FILE
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no {CONFIG_FILE}: not a (complete) converted checkpoint")
    for name in TOKENIZER_FILES:
        if (Path(path) / name).exists() and inside(path, name) is None:
            raise ConversionError(
                f"{Path(path) / name} is a link that leads outside {path}: a model's files must lie in its own"
                " directory; convert the model again"
            )
    meta = json.loads(config_file.read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise ConversionError(
            f"{config_file} has format_version {meta.get('format_version')}, expected {FORMAT_VERSION}"
        )
    check_stored_residual(meta.get("residual"), str(config_file))
    return meta


def converted_state_dict(path: str | Path) -> dict[str, Tensor]:
    """`{name: tensor}` of converted checkpoint `path`, memory-mapped (pages load when read).

    Keys match `Decoder.state_dict()`: a tied head appears as `head.weight`, the same tensor as `embed.weight`.
    """
    meta = read_converted_config(path)
    tensors = SafetensorsDir(path)
    state = {name: tensors.tensor(name) for name in tensors.names()}
    if meta["model"]["tie_embeddings"] and "embed.weight" in state:
        state["head.weight"] = state["embed.weight"]
    return state


def converted_residual(meta: dict) -> Residual:
    """The residual template that `mhar_config.json` contents `meta` record: `{class_path, init_args}`, or the
    `{name, args}` of converted checkpoints written before."""
    spec = meta["residual"]
    return make_residual(spec) if "class_path" in spec else residual_template(spec["name"], **spec["args"])


def load_converted(path: str | Path) -> tuple[ModelConfig, Residual, dict[str, Tensor]]:
    """The model config, residual template and memory-mapped state dict of converted checkpoint `path`."""
    meta = read_converted_config(path)
    return ModelConfig(**meta["model"]), converted_residual(meta), converted_state_dict(path)


def load_decoder(path: str | Path, *, dtype: torch.dtype | None = None) -> Decoder:
    """The `Decoder` stored in converted checkpoint `path` (built on meta, filled once; `dtype` defaults to stored)."""
    config, template, state = load_converted(path)
    model = meta_decoder(config, template)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    if config.tie_embeddings:
        state.pop("head.weight", None)
    check_tensors(f"converted checkpoint {path}", expected, {name: tuple(t.shape) for name, t in state.items()})
    entries = [TensorEntry(name, tuple(t.shape), dtype or t.dtype, lambda t=t: t) for name, t in state.items()]
    return materialize(model, entries)
