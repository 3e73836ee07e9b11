"""`StepProgressBar`: Lightning's rich progress bar for step-based runs, with a plain line per interval off a TTY."""

import sys
import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.utilities import rank_zero_only


class StepProgressBar(RichProgressBar):
    """On a terminal, Lightning's rich bar without the `Epoch 0/-2` of a run bounded by `max_steps`; when stdout is
    not a terminal (a log file, SLURM), where the bar draws nothing, one plain line every `every_n_steps` steps
    (default: the trainer's `log_every_n_steps`): `step 300/600 (50%) | train/loss 1.234 | 2.1 steps/s | eta 2m23s`.
    """

    def __init__(self, every_n_steps: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self._start: tuple[float, int] | None = None

    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is not None and self.trainer.max_epochs < 0:
            return f"{f'Epoch {current_epoch}':{len(self.validation_description)}}"
        return super()._get_train_description(current_epoch)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._start = (time.monotonic(), trainer.global_step)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any) -> None:
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)
        step = trainer.global_step
        every = self.every_n_steps or trainer.log_every_n_steps
        if not sys.stdout.isatty() and step > 0 and step % every == 0:
            self._print_line(trainer)

    @rank_zero_only
    def _print_line(self, trainer: L.Trainer) -> None:
        started, first_step = self._start or (time.monotonic(), 0)
        rate = (trainer.global_step - first_step) / max(time.monotonic() - started, 1e-9)
        parts = [f"step {trainer.global_step}" + (f"/{trainer.max_steps}" if trainer.max_steps > 0 else "")]
        if trainer.max_steps > 0:
            parts[0] += f" ({100 * trainer.global_step / trainer.max_steps:.0f}%)"
        metrics = self.get_metrics(trainer, trainer.lightning_module)
        parts += [
            f"{name} {value:.4g}"
            for name, value in metrics.items()
            if name != "v_num" and isinstance(value, (int, float))
        ]
        parts.append(f"{rate:.2f} steps/s")
        if trainer.max_steps > 0 and rate > 0:
            left = int((trainer.max_steps - trainer.global_step) / rate)
            parts.append(f"eta {left // 60}m{left % 60:02d}s")
        print(" | ".join(parts), flush=True)
