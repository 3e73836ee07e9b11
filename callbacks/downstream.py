"""`DownstreamTasks`: accuracy on small multiple-choice tasks at every validation, beside the validation loss."""

import time

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn

from mhar_lightning.downstream import SHIPPED, Task, load_task, task_accuracy


class DownstreamTasks(L.Callback):
    """At the end of each validation, score every task's examples with the model being trained and log the accuracy
    as `downstream/<task>/acc` (the answer must have the highest log-likelihood per byte among its choices), and
    what scoring took as `downstream/seconds`.

    Every rank scores every example (FSDP needs all ranks in each forward, and the tasks are small), eagerly (a
    compiled model would compile again for each new shape), in the Trainer's precision. The tokenizer is the data
    module's (`data.tokenizer`).

    Args:
        tasks: names of shipped tasks (`python-keywords`, `python-brackets`, `arithmetic`) or paths of JSONL files,
            one example a line: `{"context": str, "choices": [str, ...], "answer": int}`.
        max_examples: the first this many examples of each task (None: all).
        batch_size: (context, choice) rows per forward.
        every_n_validations: score at every n-th validation only.
    """

    def __init__(
        self,
        tasks: list[str] | None = None,
        max_examples: int | None = None,
        batch_size: int = 32,
        every_n_validations: int = 1,
    ) -> None:
        if batch_size < 1 or every_n_validations < 1:
            raise ValueError(
                f"batch_size and every_n_validations must be >= 1, got {batch_size}, {every_n_validations}"
            )
        self.tasks: list[Task] = [load_task(spec, max_examples) for spec in (SHIPPED if tasks is None else tasks)]
        names = [task.name for task in self.tasks]
        if len(set(names)) < len(names):
            raise ValueError(f"downstream tasks {names} share a name; give each file its own name")
        self.batch_size = batch_size
        self.every_n_validations = every_n_validations
        self._validations = 0

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self._validations += 1
        if (self._validations - 1) % self.every_n_validations:
            return
        tokenizer = getattr(trainer.datamodule, "tokenizer", None)
        if tokenizer is None:
            rank_zero_warn("DownstreamTasks: the data module has no tokenizer; no downstream scores are logged.")
            return
        decoder, device = pl_module.decoder, pl_module.device

        def model(tokens: torch.Tensor) -> torch.Tensor:
            return decoder(tokens.to(device))

        start = time.perf_counter()
        with torch.compiler.set_stance("force_eager"), trainer.precision_plugin.forward_context():
            for task in self.tasks:
                accuracy = task_accuracy(model, tokenizer, task, self.batch_size, decoder.config.max_seq_len)
                pl_module.log(f"downstream/{task.name}/acc", accuracy)
        pl_module.log("downstream/seconds", time.perf_counter() - start)
