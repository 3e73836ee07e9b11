"""A callback that runs, on resuming, the validation due at the checkpoint's step (a run killed during it)."""

import lightning as L
from lightning.pytorch.loops.evaluation_loop import RestartStage


class ResumeDueValidation(L.Callback):
    """Resuming from a checkpoint written at the end of a training step after which a validation was due, run that
    validation before the next step.

    Checkpoints saved every N steps are written before the validation that follows their step. Lightning 2.6, resuming
    from one, takes that validation as done (it fast-forwards the validation loop's counters), so a run killed during
    it never logs it. Here it runs again, from its first batch, on the checkpoint's weights, and logs the loss the
    interrupted one would have. A run that stopped cleanly after that validation logs it twice, with the same loss:
    the checkpoint cannot tell the two apart.
    """

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        epoch_loop = trainer.fit_loop.epoch_loop
        if epoch_loop.restarted_on_train_batch_end and epoch_loop._should_check_val_fx(trainer.fit_loop._data_fetcher):
            epoch_loop.val_loop.batch_progress.reset_on_run()  # from its first batch, whatever ran before
            epoch_loop.val_loop._restart_stage = RestartStage.RESTARTED_MID_EVALUATION  # the epoch loop runs it first
            if not epoch_loop._should_accumulate():  # the step ends again after the validation: count it once
                epoch_loop._batches_that_stepped -= 1
