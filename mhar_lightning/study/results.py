"""What a finished run measured, read back from its own TensorBoard logs into a small `result.json`."""

import inspect
import json
import math
import shutil
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mhar_lightning.model import Decoder
from mhar_lightning.module import LanguageModel
from mhar_lightning.parallel import routing_parameters
from mhar_lightning.probe import DepthMaps
from mhar_lightning.run_environment import ENVIRONMENT_FILE
from mhar_lightning.study.grid import RESULT_FILE

VAL_LOSS, VAL_BPB, TRAIN_LOSS = "val/loss", "val/bpb", "train/loss"
DOWNSTREAM, ACCURACY = "downstream/", "/acc"
"""Downstream task accuracies are logged as `downstream/<task>/acc` (`callbacks.DownstreamTasks`)."""
DEVICE_TOKENS_PER_SEC, TOKENS_PER_SEC = "train/device/items_per_sec", "train/items_per_sec"
PEAK_MEMORY = "memory/peak_allocated_gib"
TAGS = (VAL_LOSS, VAL_BPB, TRAIN_LOSS, DEVICE_TOKENS_PER_SEC, TOKENS_PER_SEC, PEAK_MEMORY)
DEPTH_MAPS = "depth_attention.npz"
MODEL_ARGS = set(inspect.signature(LanguageModel).parameters) - {"init_from"}
"""Hyperparameters that shape the model (the run's weights are not needed to count its parameters)."""


@dataclass
class RunResult:
    """One run: final validation loss (and bits per byte, downstream accuracies), loss curves (step, loss), speed,
    memory and size."""

    variant: str
    seed: int
    definition: str
    steps: int
    tokens_per_step: int
    params: int
    routing_params: int
    val_loss: float
    val_step: int
    val_curve: list[tuple[int, float]]
    train_curve: list[tuple[int, float]]
    tokens_per_sec: float | None
    peak_memory_gib: float | None
    initial_val_loss: float | None = None
    hparams: dict[str, Any] = field(default_factory=dict)
    shared: int = 1
    """Runs trained at the same time on its machine (`mhar compare --jobs`): above 1 its tokens/s are not its own."""
    environment: dict[str, Any] = field(default_factory=dict)
    """The device, world size and versions the run trained with (its `environment.json`; empty if not recorded)."""
    val_bpb: float | None = None
    """Bits per byte of the last validation (None for runs that did not log it)."""
    downstream: dict[str, float] = field(default_factory=dict)
    """Task -> accuracy at the last validation."""

    @property
    def tokens(self) -> int:
        return self.steps * self.tokens_per_step

    def save(self, run_dir: Path) -> Path:
        path = run_dir / RESULT_FILE
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, run_dir: Path) -> "RunResult":
        data = json.loads((run_dir / RESULT_FILE).read_text())
        for curve in ("val_curve", "train_curve"):
            data[curve] = [(int(s), float(v)) for s, v in data[curve]]
        return cls(**data)


def versions(root: Path) -> list[Path]:
    """The TensorBoard run folders under `root`, oldest first (a resumed run adds one)."""
    found = (root / "tensorboard").glob("version_*")
    return sorted(found, key=lambda p: int(p.name.removeprefix("version_")))


def has_logs(run_dir: Path) -> bool:
    """Whether `run_dir` holds the logs `read_run` reads (not only its result files, as a copied study may)."""
    found = versions(run_dir)
    return bool(found) and all((found[-1] / name).is_file() for name in ("config.yaml", "hparams.yaml"))


def read_scalars(root: Path) -> dict[str, dict[int, float]]:
    """tag -> {optimizer steps done: value} of the study's tags and any downstream accuracies, over every version
    (a later one overrides).

    Lightning logs a value at the count of steps done before the batch it belongs to, so a validation after
    step 6 is logged at 5: here it is put back at 6, the step its checkpoint has and its tokens are counted at.
    """
    scalars: dict[str, dict[int, float]] = {tag: {} for tag in TAGS}
    for version in versions(root):
        events = EventAccumulator(str(version), size_guidance={"scalars": 0})
        events.Reload()
        for tag in events.Tags()["scalars"]:
            if tag in TAGS or (tag.startswith(DOWNSTREAM) and tag.endswith(ACCURACY)):
                scalars.setdefault(tag, {}).update({event.step + 1: event.value for event in events.Scalars(tag)})
    return scalars


def model_size(hparams: dict[str, Any]) -> tuple[int, int]:
    """(all parameters, routing parameters) of the model `hparams` (LanguageModel arguments) builds, on meta."""
    model = LanguageModel(**{k: v for k, v in hparams.items() if k in MODEL_ARGS})
    with torch.device("meta"):
        decoder = Decoder(model.model_config, model.residual)
    return sum(p.numel() for p in decoder.parameters()), routing_parameters(decoder)


def tokens_per_step(config: dict[str, Any], world_size: int) -> int:
    """Trained tokens per optimizer step of a run's saved `config.yaml`."""
    accumulate = config["trainer"].get("accumulate_grad_batches") or 1
    return config["data"]["batch_size"] * config["data"]["seq_len"] * accumulate * world_size


def steady(values: dict[int, float]) -> float | None:
    """Median of the second half of a run's logged values (the first half holds warm-up and compilation)."""
    steps = sorted(values)[len(values) // 2 :]
    return statistics.median(values[s] for s in steps) if steps else None


def read_run(run_dir: Path, variant: str, seed: int, definition: str, shared: int = 1) -> RunResult:
    """The result of the finished run in `run_dir`, from its logs; also copies its last depth-attention maps there.
    A run whose logs end before its `trainer.max_steps` is refused. `shared`: the runs that trained at the same time
    on the machine."""
    found = versions(run_dir)
    if not found:
        raise ValueError(f"{run_dir} has no TensorBoard logs: not a run of `mhar fit`")
    scalars = read_scalars(run_dir)
    latest = found[-1]
    config = yaml.safe_load((latest / "config.yaml").read_text())
    steps = max([*scalars[TRAIN_LOSS], *scalars[VAL_LOSS]], default=0)
    max_steps = config["trainer"]["max_steps"]
    if steps < max_steps:  # stopped early (a signal, a callback): its last checkpoint resumes it
        raise ValueError(
            f"{run_dir} stopped at step {steps} of trainer.max_steps={max_steps}: the next call resumes it"
        )
    if not scalars[VAL_LOSS]:
        raise ValueError(f"{run_dir} logged no {VAL_LOSS}: set trainer.val_check_interval to divide trainer.max_steps")
    # hparams.yaml has the linked vocabulary, config.yaml the residual strategy
    hparams = {**yaml.safe_load((latest / "hparams.yaml").read_text()), "residual": config["model"]["residual"]}
    device_speed, speed = steady(scalars[DEVICE_TOKENS_PER_SEC]), steady(scalars[TOKENS_PER_SEC])
    world_size = round(speed / device_speed) if speed and device_speed else 1
    params, routing = model_size(hparams)
    val_step = max(scalars[VAL_LOSS])
    maps = sorted(latest.glob("depth_attention/step_*.npz"))
    if maps:
        shutil.copyfile(maps[-1], run_dir / DEPTH_MAPS)
    heads = DepthMaps.load(run_dir / DEPTH_MAPS).heads if (run_dir / DEPTH_MAPS).is_file() else None
    train = scalars[TRAIN_LOSS]
    peak = scalars[PEAK_MEMORY]
    environment = latest / ENVIRONMENT_FILE
    return RunResult(
        variant=variant,
        seed=seed,
        definition=definition,
        steps=steps,
        tokens_per_step=tokens_per_step(config, world_size),
        params=params,
        routing_params=routing,
        val_loss=scalars[VAL_LOSS][val_step],
        val_step=val_step,
        val_curve=sorted(scalars[VAL_LOSS].items()),
        train_curve=sorted(train.items()),
        tokens_per_sec=speed or device_speed,
        peak_memory_gib=max(peak.values()) if peak else None,
        initial_val_loss=initial_val_loss(run_dir),
        hparams={"residual": hparams["residual"], "preset": hparams.get("preset"), "routing_heads": heads},
        shared=shared,
        environment=json.loads(environment.read_text()) if environment.is_file() else {},
        val_bpb=scalars[VAL_BPB].get(val_step),
        downstream={
            tag.removeprefix(DOWNSTREAM).removesuffix(ACCURACY): values[val_step]
            for tag, values in scalars.items()
            if tag.startswith(DOWNSTREAM) and val_step in values
        },
    )


def initial_val_loss(run_dir: Path) -> float | None:
    """Validation loss of a continued run's starting weights (`mhar validate` into `<run>/initial`), if measured."""
    values = read_scalars(run_dir / "initial")[VAL_LOSS] if (run_dir / "initial").is_dir() else {}
    return next(iter(values.values())) if values else None


def finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)
