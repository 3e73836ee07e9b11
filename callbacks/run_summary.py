"""`RunSummary`: the closing line of a training run: where it stopped, its last validation loss, its checkpoint."""

import os
import time

import lightning as L


class RunSummary(L.Callback):
    """Print one line when a fit ends, after the progress bar has stopped drawing, on global rank 0:

        done: step 600/600 in 1m32s | val/loss 1.903 at step 600 | checkpoint runs/demo/checkpoints/last.ckpt

    It stands in for Lightning's "`Trainer.fit` stopped" message, which `mhar` drops (`terminal.py`). A run stopped
    before `max_steps` (by a callback or by a time limit) reads `stopped: step 300/600 ...`.
    """

    def __init__(self) -> None:
        self._began: float | None = None
        self._val_step: int | None = None
        self._ended = False

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._began, self._val_step, self._ended = time.monotonic(), None, False

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._val_step = trainer.global_step

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._ended = True

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and self._ended and trainer.is_global_zero:
            print(self.line(trainer), flush=True)

    def line(self, trainer: L.Trainer) -> str:
        """The summary of `trainer`'s finished fit."""
        step, max_steps = trainer.global_step, trainer.max_steps
        seconds = int(time.monotonic() - (self._began or time.monotonic()))
        done = "stopped" if 0 < max_steps and step < max_steps else "done"
        parts = [f"{done}: step {step}" + (f"/{max_steps}" if max_steps > 0 else "") + f" in {duration(seconds)}"]
        val_loss = trainer.callback_metrics.get("val/loss")
        if val_loss is not None and self._val_step is not None:
            parts.append(f"val/loss {float(val_loss):.3f} at step {self._val_step}")
        checkpoint = getattr(trainer.checkpoint_callback, "last_model_path", "") or getattr(
            trainer.checkpoint_callback, "best_model_path", ""
        )
        parts.append(f"checkpoint {shown_path(checkpoint)}" if checkpoint else "no checkpoint saved")
        return " | ".join(parts)


def shown_path(path: str) -> str:
    """`path` relative to the working directory where it lies below it, else as it is."""
    inside = os.path.abspath(path).startswith(os.getcwd() + os.sep)
    return os.path.relpath(path) if inside else path


def duration(seconds: int) -> str:
    """`1h02m`, `3m05s` or `42s`."""
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"
