"""Continued runs: a finished run's weights converted to another residual strategy, as `mhar fit --model.init_from`.

Converting a `sum` run to `delta-mhar` keeps its function (zero gates); converting it to `sum` gives the unconverted
control. Both continue from the same weights with a fresh optimizer and the same schedule, data and steps.
"""

import json
from pathlib import Path
from typing import Any

import torch

from mhar_lightning.config import ModelConfig
from mhar_lightning.convert.checkpoint import (
    CONFIG_FILE,
    FORMAT_VERSION,
    meta_decoder,
    residual_template,
    routing_entries,
)
from mhar_lightning.convert.safetensors_io import DEFAULT_SHARD_SIZE, TensorEntry, fresh_dir, parse_size, write_sharded
from mhar_lightning.module import LanguageModel
from mhar_lightning.residual import Residual, make_residual
from mhar_lightning.residual.trust import check_stored_residual
from mhar_lightning.study.results import MODEL_ARGS

PREFIX = "decoder."


def residual_of(spec: str | dict[str, Any]) -> Residual:
    """The strategy template a variant's `--model.residual` value names."""
    return residual_template(spec) if isinstance(spec, str) else make_residual(spec)


def convert_checkpoint(ckpt: Path, out: Path, residual: str | dict[str, Any]) -> Path:
    """Write the weights of `mhar fit` checkpoint `ckpt` as a converted checkpoint `out` for strategy `residual`.

    The source's own routing parameters are dropped and the target's are freshly initialised, so this suits
    sources without routing (`sum`) and targets that start as the identity of the source (`sum`, `delta-mhar`).
    """
    checkpoint = torch.load(ckpt, map_location="cpu", mmap=True, weights_only=True)
    recorded = checkpoint["hyper_parameters"]
    if "model_config" in recorded:
        config = ModelConfig(**recorded["model_config"])
    else:  # a checkpoint written before runs recorded their whole shape
        check_stored_residual(recorded.get("residual"), f"checkpoint {ckpt}")
        config = LanguageModel(**{k: v for k, v in recorded.items() if k in MODEL_ARGS}).model_config
    template = residual_of(residual)
    model = meta_decoder(config, template)
    routing = routing_entries(model, torch.float32)
    routed = {entry.name for entry in routing}
    state = {k.removeprefix(PREFIX): v for k, v in checkpoint["state_dict"].items() if k.startswith(PREFIX)}
    names = [
        name
        for name in model.state_dict()
        if name not in routed and not (config.tie_embeddings and name == "head.weight")
    ]
    missing = [name for name in names if name not in state]
    if missing:
        raise ValueError(f"{ckpt} lacks {', '.join(missing[:3])}: convert a checkpoint of the same model shape")
    entries = [TensorEntry(n, tuple(state[n].shape), state[n].dtype, lambda t=state[n]: t) for n in names]
    out = fresh_dir(out)
    write_sharded(out, entries + routing, parse_size(DEFAULT_SHARD_SIZE))
    meta = {
        "format_version": FORMAT_VERSION,
        "model": config.to_dict(),
        "residual": template.spec(),
        "dtype": "float32",
        "source": {"path": str(ckpt.resolve()), "step": checkpoint.get("global_step")},
    }
    (out / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return out
