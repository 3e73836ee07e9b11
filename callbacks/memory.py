"""`PeakMemoryMonitor`: peak GPU memory of training, logged with the other step metrics."""

from typing import Any

import lightning as L
import torch
from mhar_lightning.callbacks.base import log_scalars

GIB = 2**30


class PeakMemoryMonitor(L.Callback):
    """Log `memory/peak_allocated_gib` and `memory/peak_reserved_gib` (max over ranks) every
    `log_every_n_steps` optimizer steps (None: the trainer's `log_every_n_steps`).

    Peaks are since the start of the process (`torch.cuda.max_memory_allocated` / `max_memory_reserved`),
    so the curve is the high-water mark so far. On CPU it does nothing.
    """

    def __init__(self, log_every_n_steps: int | None = None) -> None:
        self.log_every_n_steps = log_every_n_steps
        self._last_step = -1

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        device = pl_module.device
        every = self.log_every_n_steps or trainer.log_every_n_steps
        step = trainer.global_step
        if device.type != "cuda" or step % every or step == self._last_step:
            return
        self._last_step = step
        peaks = torch.tensor(
            [torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)], device=device
        )
        if trainer.world_size > 1:
            peaks = trainer.strategy.reduce(peaks.double(), reduce_op="max")
        allocated, reserved = (float(v) / GIB for v in peaks)
        if trainer.is_global_zero:
            log_scalars(trainer, {"memory/peak_allocated_gib": allocated, "memory/peak_reserved_gib": reserved}, step)
