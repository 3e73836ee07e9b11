"""Runs that start from a converted checkpoint: its directory fixes the model's shape, flags may only agree with it."""

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from mhar_lightning.config import ModelConfig
from mhar_lightning.convert.checkpoint import CONFIG_FILE, converted_residual, read_converted_config
from mhar_lightning.convert.safetensors_io import ConversionError, SafetensorsDir
from mhar_lightning.data.tokenizer import Tokenizer, load_tokenizer
from mhar_lightning.residual import RESIDUALS, Residual, make_residual, residual_name

RUN_FIELDS = ("max_seq_len",)
"""`ModelConfig` fields a run sets itself (from `data.seq_len`), whatever the directory says."""


def pretrained_model(
    init_from: str | Path,
    *,
    preset: str | None = None,
    residual: Residual | str | Mapping[str, Any] | None = None,
    overrides: Mapping[str, Any] | None = None,
    vocab_size: int | None = None,
    seq_len: int | None = None,
) -> tuple[ModelConfig, Residual]:
    """The model config and residual template stored in converted checkpoint `init_from`.

    `preset`, `residual` and `overrides` are what the user gave; each must agree with the directory (a
    contradiction is refused, naming both values). `vocab_size` is the data tokenizer's, which must fit the model's.
    """
    if not (Path(init_from) / CONFIG_FILE).is_file():
        what = "a Hugging Face model" if (Path(init_from) / "config.json").is_file() else "not a converted checkpoint"
        raise ConversionError(
            f"init_from={init_from} is {what} (it has no {CONFIG_FILE}): convert one with "
            f"`mhar convert-hf SRC OUT --residual ...` and pass OUT"
        )
    meta = read_converted_config(init_from)
    SafetensorsDir(init_from)  # its index is refused now, not after the trainer has started
    config = ModelConfig(**meta["model"])
    template = converted_residual(meta)
    where = f"init_from={init_from}"
    overrides = dict(overrides or {})
    run = {f: overrides.pop(f) for f in RUN_FIELDS if f in overrides}
    if seq_len is not None:
        run["max_seq_len"] = seq_len
    if preset is not None:  # a preset names every field
        given, flag = ModelConfig.preset(preset, **overrides), f"model.preset={preset}"
        fields = [f for f in config.to_dict() if f not in RUN_FIELDS]
    else:  # typed values (e.g. rope_scaling) built the way the directory's are
        given, flag, fields = replace(config, **overrides), "model.model_overrides", list(overrides)
    check_agree(flag, {f: getattr(given, f) for f in fields}, config, where)
    if residual is not None:
        check_residual(residual, template, residual_name(template), where)
    if vocab_size is not None and vocab_size > config.vocab_size:
        raise ConversionError(
            f"data.tokenizer has {vocab_size} tokens but the model of {where} has a {config.vocab_size}-token "
            f"vocabulary: use the model's own tokenizer, --data.tokenizer {init_from}"
        )
    return replace(config, **run), template


def check_agree(flag: str, given: Mapping[str, Any], config: ModelConfig, where: str) -> None:
    """Refuse the first field of `given` that differs from `config`'s, naming both values."""
    for field, value in given.items():
        if value != getattr(config, field):
            raise ConversionError(
                f"{flag} sets {field}={value!r} but {where} has {field}={getattr(config, field)!r}: remove the flag "
                "(the model's shape comes from the converted directory)"
            )


def check_residual(residual: Residual | str | Mapping[str, Any], template: Residual, name: str, where: str) -> None:
    """Refuse a residual strategy, or an argument of it, that differs from the directory's `template`."""
    if isinstance(residual, str):
        cls, args = RESIDUALS.get(residual), {}
    elif isinstance(residual, Mapping):
        cls, args = type(make_residual(residual)), dict(residual.get("init_args") or {})
    else:
        cls, args = type(residual), residual.spec()["init_args"]
    if cls is not type(template):
        given = residual if isinstance(residual, str) else cls.__name__
        raise ConversionError(
            f"model.residual={given} but {where} holds a {name!r} model: remove model.residual (it comes from the "
            "converted directory) or convert again with --residual"
        )
    stored = template.spec()["init_args"]
    for arg, value in args.items():
        if arg in stored and value != stored[arg]:
            raise ConversionError(
                f"model.residual sets {arg}={value!r} but {where} has {arg}={stored[arg]!r}: remove the argument "
                "(it comes from the converted directory) or convert again with other routing arguments"
            )


def directory_tokenizer(init_from: str | Path) -> Tokenizer | None:
    """The tokenizer that converted checkpoint `init_from` ships (copied from its source), or None."""
    try:
        return load_tokenizer(str(init_from))
    except FileNotFoundError:
        return None


def check_data_tokenizer(init_from: str | Path, tokenizer: Tokenizer, requested: str) -> None:
    """Refuse training data tokenized otherwise than with the tokenizer `init_from` ships (when it ships one)."""
    shipped = directory_tokenizer(init_from)
    if shipped is not None and shipped.fingerprint != tokenizer.fingerprint:
        raise ConversionError(
            f"data.tokenizer={requested} is not the tokenizer that init_from={init_from} ships (its tokenizer files "
            f"differ): use --data.tokenizer {init_from}"
        )
