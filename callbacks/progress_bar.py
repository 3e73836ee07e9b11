"""`StepProgressBar`: Lightning's rich progress bar for step-based runs, without a GPU synchronisation at every step,
with tokens/s and MFU beside the loss, and a plain line per interval when output is not a terminal."""

import sys
import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.utilities import rank_zero_only
from mhar_lightning.callbacks.throughput import TokenThroughputMonitor
from torch import Tensor


class StepProgressBar(RichProgressBar):
    """The rich bar, showing `metrics` (training metrics by name) refreshed every `every_n_steps` steps (default: the
    trainer's `log_every_n_steps`), without the `Epoch 0/-2` of a run bounded by `max_steps`.

    Showing a metric copies it to the host, which waits for the GPU to finish the step. Lightning does that after
    every step for each metric logged with `prog_bar=True`, so the host never runs ahead of the GPU and a compiled
    model trains several per cent slower. The kit logs its training loss without `prog_bar`; this bar reads it, and
    any other metric named here, from the trainer's callback metrics only when it refreshes them. The step count
    still advances every step. Beside the metrics it shows the tokens/s (over all devices) and MFU that the
    `TokenThroughputMonitor` logged last. When stdout is not a terminal (a log file, SLURM), where a rich bar would
    only print its final state, it prints one plain line per interval instead, every number with fixed decimals:
    `step 300/600 (50%) | train/loss 1.234 | tok/s 15,872 | MFU 41.2% | 2.10 steps/s | eta 2m23s`. Speed and time
    left count from the end of the run's first step, which holds the compilation.

    Args:
        metrics: names of logged metrics to show.
        every_n_steps: steps between metric refreshes and plain lines (None: `trainer.log_every_n_steps`).
    """

    def __init__(
        self, metrics: tuple[str, ...] = ("train/loss",), every_n_steps: int | None = None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.metrics = tuple(metrics)
        self.every_n_steps = every_n_steps
        self._start: tuple[float, int] | None = None  # (time, step) at the end of the run's first step
        self._first_step = 0

    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is not None and self.trainer.max_epochs < 0:
            return f"{f'Epoch {current_epoch}':{len(self.validation_description)}}"
        return super()._get_train_description(current_epoch)

    def _by_steps(self) -> bool:
        """A run bounded by `max_steps` alone: the bar counts optimizer steps out of `max_steps`, not the batches of
        an epoch (after a resume Lightning's count would read 620/20: the epoch's batch index over the steps left)."""
        trainer = self.trainer
        return trainer.max_epochs is not None and trainer.max_epochs < 0 and trainer.max_steps > 0

    @property
    def total_train_batches(self) -> int | float:
        return self.trainer.max_steps if self._by_steps() else super().total_train_batches

    def _start_at_step(self, trainer: L.Trainer) -> None:
        """Start the bar of a `max_steps` run at the steps already done, so that a resumed run's speed and times are
        its own, not those of a jump from 0 to its first step."""
        if not self._by_steps() or self.progress is None:
            return
        if self.train_progress_bar_id is None:  # Lightning adds it at an epoch start, which a resume skips
            self._initialize_train_progress_bar_id()
        self.progress.reset(self.train_progress_bar_id, completed=trainer.global_step)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if not sys.stdout.isatty():
            self.disable()  # the plain lines instead

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._start, self._first_step = None, trainer.global_step
        self._start_at_step(trainer)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        self._start_at_step(trainer)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self._start is None and step > self._first_step:
            self._start = (time.monotonic(), step)
        done = step if self._by_steps() else batch_idx + 1
        if step % (self.every_n_steps or max(1, trainer.log_every_n_steps)):
            if not self.is_disabled and self.train_progress_bar_id is None:
                self._initialize_train_progress_bar_id()
            self._update(self.train_progress_bar_id, done)
            self.refresh()
            return
        super().on_train_batch_end(trainer, pl_module, outputs, batch, done - 1)
        if step > 0 and not sys.stdout.isatty():
            self._print_line(trainer)

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        shown = super().get_metrics(trainer, pl_module)
        shown.pop("v_num", None)
        for name in self.metrics:
            value = trainer.callback_metrics.get(name)
            if isinstance(value, Tensor) and value.numel() == 1:
                shown[name] = float(value)
        return shown | throughput(trainer)

    @rank_zero_only
    def _print_line(self, trainer: L.Trainer) -> None:
        parts = [f"step {trainer.global_step}" + (f"/{trainer.max_steps}" if trainer.max_steps > 0 else "")]
        if trainer.max_steps > 0:
            parts[0] += f" ({100 * trainer.global_step / trainer.max_steps:.0f}%)"
        for name, value in self.get_metrics(trainer, trainer.lightning_module).items():
            parts.append(f"{name} {value if isinstance(value, str) else format(value, self.theme.metrics_format)}")
        started, first_step = self._start or (0.0, trainer.global_step)
        if trainer.global_step > first_step:
            rate = (trainer.global_step - first_step) / max(time.monotonic() - started, 1e-9)
            parts.append(f"{rate:.2f} steps/s")
            if trainer.max_steps > 0:
                left = int((trainer.max_steps - trainer.global_step) / rate)
                parts.append(f"eta {left // 60}m{left % 60:02d}s")
        print(" | ".join(parts), flush=True)


def throughput(trainer: L.Trainer) -> dict[str, str]:
    """The last tokens/s (over all devices) and MFU that the trainer's `TokenThroughputMonitor` logged, as text."""
    monitor = next((c for c in trainer.callbacks if isinstance(c, TokenThroughputMonitor)), None)
    latest = monitor.latest if monitor is not None else {}
    tokens = latest.get("train/items_per_sec", latest.get("train/device/items_per_sec"))
    shown = {} if tokens is None else {"tok/s": f"{tokens:,.0f}"}
    if "train/device/mfu" in latest:
        shown["MFU"] = f"{latest['train/device/mfu']:.1%}"
    return shown
