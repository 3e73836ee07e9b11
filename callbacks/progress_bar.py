"""`StepProgressBar`: Lightning's rich progress bar without a GPU synchronisation at every step."""

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar


class StepProgressBar(RichProgressBar):
    """The rich progress bar, with its metrics (loss, ...) refreshed every `trainer.log_every_n_steps` steps.

    Showing a metric copies it to the host, which waits for the GPU to finish the step: Lightning's bar does that
    after every step, so the host never runs ahead of the GPU, and a compiled model trains several per cent slower.
    The step count still advances every step.
    """

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
