"""Resuming keeps the checkpoint's model: a model flag that contradicts the checkpoint is refused, not overridden.

Lightning's CLI replaces the model arguments with the checkpoint's hyperparameters when `ckpt_path` is a file, so
`--model.residual sum` on an MHAR checkpoint used to train the MHAR model and exit 0. Here every model argument
the user gave (in a config file or a flag) is compared with the checkpoint first: a checkpoint of another model
(residual, shape) is named as such in one line, before any single setting. Arguments that only choose how the same
model runs (`RUNTIME_FIELDS`) may change on resume and keep the user's value.
"""

from dataclasses import asdict
from typing import Any

from mhar_lightning.config import ModelConfig
from mhar_lightning.errors import CheckpointError, ConfigError
from mhar_lightning.optim import OptimizerConfig
from mhar_lightning.residual import make_residual

RUNTIME_FIELDS = frozenset(
    {
        "compile",
        "compile_options",
        "compiled_autograd",
        "activation_checkpointing",
        "loss_chunk_tokens",
        "param_dtype",
        "reduce_dtype",
        "init_from",
        "skip_nonfinite",
    }
)
TRAINING_FIELDS = frozenset({"optimizer", "grad_clip"})  # used by `fit` only: `validate` may differ in them
LINKED_FIELDS = frozenset({"vocab_size", "seq_len"})  # set from the data config and checked against it elsewhere
SIZE_FIELDS = frozenset({"vocab_size", "max_seq_len"})  # of the shape, set from the data (checked against it elsewhere)


def check_same_model(
    given: dict[str, Any],
    model: dict[str, Any],
    hparams: dict[str, Any],
    path: str,
    tokenizers: tuple[str | None, str | None],
    training: bool = True,
) -> None:
    """Raise `CheckpointError`, naming every difference in one line, when the residual or the shape the user gave
    (`given`, `model` as in `runtime_overrides`) is not the checkpoint's; `tokenizers` (the config's, the
    checkpoint's) add the vocabulary to that line when they differ too."""
    parts = []
    if "residual" in given and "residual" in hparams:
        residual = differences("residual", None, model["residual"], hparams)
        parts += [f"residual {mine} vs {theirs}" for _, mine, theirs in residual]
    trained = hparams.get("model_config")
    if trained and model.get("init_from") is None and given.keys() & {"preset", "model_overrides"}:
        try:
            mine = ModelConfig.preset(model.get("preset") or "tiny", **(model.get("model_overrides") or {})).to_dict()
        except (TypeError, ValueError):
            mine = {}  # refused with its own message when the model is built
        differ = sorted(key for key in mine.keys() - SIZE_FIELDS if mine[key] != trained.get(key, mine[key]))
        shape = [f"{key} {mine[key]} vs {trained[key]}" for key in differ]
        if shape:
            parts.append("shape " + ", ".join(shape))
    if not parts:
        return
    if None not in tokenizers and tokenizers[0] != tokenizers[1]:
        parts.append(f"vocabulary {tokenizers[0]} vs {tokenizers[1]}")
    fix = (
        "resume it with the settings it was trained with (the config.yaml under its run folder records them), or drop"
        " --ckpt_path to train the config's model from the start"
        if training
        else "validate it with the settings it was trained with (the config.yaml under its run folder records them)"
    )
    raise CheckpointError(
        f"checkpoint {path} is a different model from the config's ({'; '.join(parts)}; the config's first): {fix}"
    )


def runtime_overrides(
    given: dict[str, Any], model: dict[str, Any], hparams: dict[str, Any], path: str, training: bool = True
) -> dict:
    """The user's runtime fields to keep; raises `CheckpointError` on a given model field the checkpoint contradicts.

    `given` holds only what the user set (nested dicts), `model` the whole parsed model config, `hparams` the
    checkpoint's `hyper_parameters`; `training` is False for `validate`, where the optimizer settings do not count.
    """
    runtime = RUNTIME_FIELDS if training else RUNTIME_FIELDS | TRAINING_FIELDS
    for field in sorted(given.keys() - runtime - LINKED_FIELDS):
        if field not in hparams:
            continue
        for name, mine, theirs in differences(field, given[field], model[field], hparams):
            fix = (
                "a resumed run keeps its model and optimizer, so drop the flag (another model or optimizer is a new"
                " run, e.g. from converted weights with --model.init_from)"
                if training
                else "validation runs the checkpoint's model, so drop the flag or give the value it was trained with"
                " (a recipe's model settings count as given)"
            )
            raise CheckpointError(
                f"--model.{name}={mine} contradicts checkpoint {path}, trained with {name}={theirs}: {fix}"
            )
    return {field: model[field] for field in given.keys() & runtime}


def differences(field: str, given: Any, value: Any, hparams: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(dotted name, user's value, checkpoint's value) for each part of `field` that differs."""
    if field == "residual":
        try:
            mine, theirs = make_residual(value).spec(), make_residual(hparams[field]).spec()
        except ValueError as error:
            raise ConfigError(str(error)) from error
        return [] if mine == theirs else [(field, compact(mine), compact(theirs))]
    if field == "model_overrides":
        trained = ModelConfig.preset(hparams.get("preset", "tiny"), **(hparams.get(field) or {}))
        return [
            (f"{field}.{key}", value[key], getattr(trained, key, None))
            for key in (given or {})
            if value[key] != getattr(trained, key, None)
        ]
    if field == "optimizer":
        mine, theirs = optimizer_fields(value), optimizer_fields(hparams[field])
        return [(f"{field}.{key}", mine[key], theirs.get(key)) for key in (given or {}) if mine[key] != theirs.get(key)]
    return [] if value == hparams[field] else [(field, value, hparams[field])]


def optimizer_fields(config: dict[str, Any]) -> dict[str, Any]:
    """An optimizer config (parsed or saved) in the checkpoint's form: every field, the schedule as its name."""
    fields = asdict(OptimizerConfig(**config))
    return {**fields, "schedule": str(fields["schedule"]), "betas": tuple(fields["betas"])}


def compact(spec: dict[str, Any]) -> str:
    """A residual spec as `Class(arg=value, ...)`."""
    args = ", ".join(f"{k}={v}" for k, v in spec["init_args"].items())
    return f"{spec['class_path'].rsplit('.', 1)[-1]}({args})"
