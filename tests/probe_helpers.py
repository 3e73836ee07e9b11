"""Shared by the depth-attention and inspect tests: a small prepared corpus, a short demo fit, a fake trainer."""

import contextlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import torch
from cli_helpers import fast_demo_args
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import Tensor
from torch.utils.data import DataLoader

from mhar_lightning.cli import main as mhar
from mhar_lightning.data.corpus import stdlib_files
from mhar_lightning.data.prepare import prepare_files
from mhar_lightning.data.tokenizer import load_tokenizer


def small_corpus(out: Path) -> Path:
    """Forty standard-library files as byte tokens with a validation split (about 2 MB, prepared in a second)."""
    prepare_files(stdlib_files()[:40], out, load_tokenizer("byte"), val_fraction=0.2, progress=False)
    return out


def demo_fit(root: Path, data: Path, max_steps: int, *overrides: str) -> Path:
    """`mhar fit --config recipes/demo.yaml` shrunk to `max_steps` steps on `data`; returns `root`."""
    try:
        mhar([*fast_demo_args(root, max_steps), "--data.path", str(data), *overrides])
    except SystemExit as exit_:
        assert not exit_.code, f"mhar fit exited with {exit_.code}"
    return root


def events(log_dir: Path) -> EventAccumulator:
    """Every image, scalar and histogram event of one TensorBoard run folder."""
    accumulator = EventAccumulator(str(log_dir), size_guidance={"images": 0, "scalars": 0, "histograms": 0})
    accumulator.Reload()
    return accumulator


class RecordingLogger:
    """A logger stub that keeps what `log_metrics` received."""

    def __init__(self) -> None:
        self.metrics: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.metrics.append((step, metrics))


class MeanReduceStrategy:
    """Stands in for a two-rank DDP strategy whose other rank holds zeros: a mean halves every value."""

    def __init__(self) -> None:
        self.reduced: list[Tensor] = []

    def reduce(self, tensor: Tensor, reduce_op: str) -> Tensor:
        assert reduce_op == "mean"
        self.reduced.append(tensor)
        return tensor / 2


def fake_trainer(log_dir: Path, batch: Tensor, rank: int = 0, world_size: int = 1, loggers: list[Any] | None = None):
    """The few Trainer attributes the probe callbacks read, for one rank of a `world_size`-process run."""
    return SimpleNamespace(
        global_step=7,
        world_size=world_size,
        is_global_zero=rank == 0,
        strategy=MeanReduceStrategy(),
        precision_plugin=SimpleNamespace(forward_context=contextlib.nullcontext),
        loggers=loggers if loggers is not None else [RecordingLogger()],
        val_dataloaders=DataLoader(batch, batch_size=len(batch)),
        datamodule=None,
        log_dir=str(log_dir),
        default_root_dir=str(log_dir),
    )


def scalar(accumulator: EventAccumulator, tag: str) -> float:
    """The last value of a scalar tag."""
    return accumulator.Scalars(tag)[-1].value


def log_at_train_end(tmp_path: Path, model: L.LightningModule, callback: L.Callback) -> EventAccumulator:
    """Run `callback`'s end-of-training probe once into a real TensorBoard log and read the events back."""
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    trainer = fake_trainer(logger.log_dir, torch.randint(0, 256, (2, 9)), loggers=[logger])
    callback.setup(trainer, model, "fit")
    callback.on_train_end(trainer, model)
    logger.finalize("success")
    return events(Path(logger.log_dir))
