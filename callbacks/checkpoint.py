"""Lightning's `ModelCheckpoint` without its two ways of leaving the newest training state unnamed."""

import os
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from mhar_lightning.checkpoint.digest import record_sharded_digest
from mhar_lightning.divergence import weights_finite
from mhar_lightning.errors import TrainingDiverged


class FinalStepCheckpoint(ModelCheckpoint):
    """`ModelCheckpoint` (same arguments) that also saves the step a run ends at and keeps `last.ckpt` current.

    Lightning 2.6 leaves two gaps that cost users training: a run that ends between `every_n_train_steps` saves
    (at `max_steps` or `max_epochs`) does not save its last steps, and a run resumed from its first checkpoint
    writes `last-v1.ckpt` beside a `last.ckpt` that still names the checkpoint it resumed from. Here a run without
    a monitored metric saves the step it ends at (a top-k checkpoint and `last`), and a resumed run takes over the
    `last.ckpt` of the directory it resumed from. A fresh run never overwrites an earlier run's `last.ckpt`.
    A run stopped by SIGTERM (a scheduler's preemption) between training steps saves the step it stopped at.
    Weights that are not finite are never saved: the run stops instead, keeping the last finite checkpoint.
    A sharded checkpoint records the digest of its files (a single file records its own as it is written).
    """

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        super().on_train_start(trainer, pl_module)
        if not (self.save_last and trainer.ckpt_path and self.dirpath) or self.last_model_path:
            return
        last = self.format_checkpoint_name(self._monitor_candidates(trainer), self.CHECKPOINT_NAME_LAST)
        resumed_here = os.path.dirname(os.path.abspath(trainer.ckpt_path)) == os.path.abspath(self.dirpath)
        if resumed_here and self._fs.lexists(last):
            self.last_model_path = last

    def on_train_batch_end(self, trainer: "pl.Trainer", *args, **kwargs) -> None:
        super().on_train_batch_end(trainer, *args, **kwargs)
        if 0 < trainer.max_steps <= trainer.global_step:
            self._save_final(trainer)  # inside the step, so a resume continues the epoch

    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if 0 < trainer.max_epochs <= trainer.current_epoch + 1:
            self._save_final(trainer)

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException) and trainer.training:  # not in the middle of a validation
            self._save_final(trainer)

    def _save_final(self, trainer: "pl.Trainer") -> None:
        """Save a top-k checkpoint and `last` for the step training stops at, unless this step is saved already."""
        if self.monitor is None and not self._should_skip_saving_checkpoint(trainer):
            candidates = self._monitor_candidates(trainer)
            if self.save_top_k != 0:
                self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)

    def _save_checkpoint(self, trainer: "pl.Trainer", filepath: str) -> None:
        if not weights_finite(trainer.lightning_module, trainer):
            raise TrainingDiverged(
                f"training diverged: the weights after step {trainer.global_step} are not finite, so {filepath} was"
                " not written: lower --model.optimizer.lr and resume from the last checkpoint (--ckpt_path last)"
            )
        super()._save_checkpoint(trainer, filepath)
        if os.path.isdir(filepath):  # sharded: a folder written by every rank, whose digest they record together
            record_sharded_digest(Path(filepath), trainer.global_rank)
