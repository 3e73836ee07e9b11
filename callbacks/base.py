"""`ProbeCallback`: the schedule, fixed probe batch and rank-0 writing shared by the depth-attention callbacks."""

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.utils.tensorboard import SummaryWriter

from mhar_lightning.probe import DepthMaps, routers_of, run_probe

_SHARED_MAPS = "_mhar_depth_maps"
"""Trainer attribute holding (step, module, maps) of the latest probe, so that the callbacks run one forward a step."""


class ProbeCallback(L.Callback, ABC):
    """Every `every_n_steps` optimizer steps and at the end of training, probe the model and `write` the maps.

    The probe batch is fixed once: the first batch of the validation dataloader (the first training batch
    if there is none), cut to `max_rows` rows, on the module's device. Every rank runs the probe (FSDP needs
    all ranks in the forward) and the statistics are averaged over ranks; only global rank 0 writes.
    """

    def __init__(self, every_n_steps: int = 500, max_rows: int | None = 8) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.max_rows = max_rows
        self._batch: Tensor | None = None
        self._first_train_batch: Tensor | None = None
        self._last_step = -1
        self._enabled: bool | None = None
        self.log_dir = Path(".")

    @abstractmethod
    def write(self, trainer: L.Trainer, maps: DepthMaps, step: int) -> None:
        """Log `maps` for optimizer step `step` (called on global rank 0 only)."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Trainer.log_dir broadcasts from rank 0, so it is read here, on every rank, not inside `write`.
        self.log_dir = Path(trainer.log_dir or trainer.default_root_dir)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._first_train_batch is None and isinstance(batch, Tensor):
            self._first_train_batch = batch.detach()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step > 0 and step % self.every_n_steps == 0 and step != self._last_step:
            self.probe(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step != self._last_step:
            self.probe(trainer, pl_module)
        if self._has_routers(pl_module):
            maps = self._maps(trainer, pl_module)
            if trainer.is_global_zero:
                self.write_final(trainer, maps, trainer.global_step)

    def probe(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Run the probe on every rank, average over ranks, write on rank 0."""
        self._last_step = trainer.global_step
        if not self._has_routers(pl_module):
            return
        maps = self._maps(trainer, pl_module)
        if trainer.is_global_zero:
            self.write(trainer, maps, trainer.global_step)

    def write_final(self, trainer: L.Trainer, maps: DepthMaps, step: int) -> None:
        """Log what is too slow to draw at every probe, once at the end of training (rank 0; nothing by default)."""

    def _maps(self, trainer: L.Trainer, pl_module: L.LightningModule) -> DepthMaps:
        """This step's maps: probed once per step and model, and shared by every probe callback of the trainer."""
        shared = getattr(trainer, _SHARED_MAPS, None)
        if shared is not None and shared[0] == trainer.global_step and shared[1] is pl_module:
            return shared[2]
        tokens = self._probe_tokens(trainer, pl_module)
        # Eager: a compiled model would otherwise compile every block again for the probe's no-grad capture.
        with torch.compiler.set_stance("force_eager"), trainer.precision_plugin.forward_context():
            maps = run_probe(pl_module, tokens, reduce=lambda t: self._mean_over_ranks(trainer, pl_module, t))
        setattr(trainer, _SHARED_MAPS, (trainer.global_step, pl_module, maps))
        return maps

    @staticmethod
    def _mean_over_ranks(trainer: L.Trainer, pl_module: L.LightningModule, t: Tensor) -> Tensor:
        if trainer.world_size == 1:
            return t
        return trainer.strategy.reduce(t.to(pl_module.device), reduce_op="mean").cpu()

    def _has_routers(self, pl_module: L.LightningModule) -> bool:
        if self._enabled is None:
            self._enabled = bool(routers_of(pl_module))
            if not self._enabled:
                rank_zero_info(
                    f"{type(self).__name__}: the model's residual has no depth routing (e.g. 'sum'); nothing to log."
                )
        return self._enabled

    def _probe_tokens(self, trainer: L.Trainer, pl_module: L.LightningModule) -> Tensor:
        """Model input [rows, T] of the fixed probe batch (a [B, T + 1] token window batch)."""
        if self._batch is None:
            batch = self._first_val_batch(trainer)
            if batch is None:
                rank_zero_warn(f"{type(self).__name__}: no validation data; probing the first training batch instead.")
                batch = self._first_train_batch
            if not isinstance(batch, Tensor):
                raise TypeError(f"{type(self).__name__} expects [B, T + 1] token tensors as batches, got {type(batch)}")
            self._batch = batch[: self.max_rows, :-1].to(pl_module.device)
        return self._batch

    @staticmethod
    def _first_val_batch(trainer: L.Trainer) -> Any:
        loaders = trainer.val_dataloaders
        if loaders is None and trainer.datamodule is not None:
            try:
                loaders = trainer.datamodule.val_dataloader()
            except (RuntimeError, NotImplementedError, AttributeError):
                loaders = None
        if isinstance(loaders, (list, tuple)):
            loaders = loaders[0] if loaders else None
        return None if loaders is None else next(iter(loaders), None)


def log_scalars(trainer: L.Trainer, metrics: dict[str, float], step: int) -> None:
    """Send scalars to every logger of the trainer."""
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)


def tensorboard(trainer: L.Trainer) -> SummaryWriter | None:
    """The trainer's TensorBoard writer, or None (images and histograms are then skipped)."""
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            return logger.experiment
    return None


def add_image(writer: SummaryWriter, tag: str, image: np.ndarray, step: int) -> None:
    writer.add_image(tag, image, step, dataformats="HWC")
