"""`StepProgressBar`: Lightning's rich progress bar without a GPU synchronisation at every step."""

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar
from torch import Tensor


class StepProgressBar(RichProgressBar):
    """The rich progress bar, showing `metrics` (training metrics by name) refreshed every `log_every_n_steps`.

    Showing a metric copies it to the host, which waits for the GPU to finish the step. Lightning does that after
    every step for each metric logged with `prog_bar=True`, so the host never runs ahead of the GPU and a compiled
    model trains several per cent slower. The kit logs its training loss without `prog_bar`; this bar reads it, and
    any other metric named here, from the trainer's callback metrics only when it refreshes them. The step count
    still advances every step.

    Args:
        metrics: names of logged metrics to show.
    """

    def __init__(self, metrics: tuple[str, ...] = ("train/loss",), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.metrics = tuple(metrics)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step % max(1, trainer.log_every_n_steps) == 0:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        if not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()
        self._update(self.train_progress_bar_id, batch_idx + 1)
        self.refresh()

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        shown = super().get_metrics(trainer, pl_module)
        shown.pop("v_num", None)
        for name in self.metrics:
            value = trainer.callback_metrics.get(name)
            if isinstance(value, Tensor) and value.numel() == 1:
                shown[name] = f"{float(value):.4g}"
        return shown
