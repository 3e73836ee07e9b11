"""Stop (or skip) a training step whose loss or gradient norm is not finite, the same way on every rank."""

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from mhar_lightning.errors import CheckpointError, TrainingDiverged


class NonFiniteGuard:
    """Decides, before each optimizer step, whether the step's loss and gradient norm are finite.

    A bad step raises `TrainingDiverged`, so the optimizer never applies it and no checkpoint is written for it;
    with `skip_limit` > 0 up to that many bad steps in a row are skipped instead (their gradients dropped) and
    warned about. The decision is all-reduced, so every rank of a DDP or FSDP run takes the same one.
    """

    def __init__(self, skip_limit: int = 0) -> None:
        if skip_limit < 0:
            raise ValueError(f"skip_nonfinite={skip_limit} must be >= 0 (0 stops at the first non-finite step)")
        self.skip_limit = skip_limit
        self.skipped_in_a_row = 0
        self.skipped = 0
        self._bad_loss: Tensor | None = None

    def watch_loss(self, loss: Tensor) -> None:
        """Remember whether a micro-batch's loss is finite (no host sync; `check` reads it)."""
        bad = ~torch.isfinite(loss.detach())
        self._bad_loss = bad if self._bad_loss is None else self._bad_loss | bad

    def check(self, trainer: L.Trainer, grad_norm: Tensor) -> bool:
        """True when this step must be skipped; raises `TrainingDiverged` when the run must stop.

        One all-reduce and one host sync of two flags per optimizer step.
        """
        bad_loss = self._bad_loss if self._bad_loss is not None else torch.zeros((), dtype=torch.bool)
        self._bad_loss = None
        device = grad_norm.device
        flags = torch.stack([bad_loss.to(device), ~torch.isfinite(grad_norm)]).float()
        flags = trainer.strategy.reduce(flags, reduce_op="sum")
        loss_bad, norm_bad = (flags > 0).tolist()
        if not (loss_bad or norm_bad):
            self.skipped_in_a_row = 0
            return False
        step = trainer.global_step + 1
        what = " and ".join(
            [
                *(["the loss is not finite"] if loss_bad else []),
                *([f"the gradient norm is {float(grad_norm)}"] * norm_bad),
            ]
        )
        self.skipped_in_a_row += 1
        if self.skipped_in_a_row > self.skip_limit:
            skipped = f" after skipping {self.skip_limit} bad steps in a row" if self.skip_limit else ""
            raise TrainingDiverged(
                f"training diverged at step {step}{skipped}: {what}; the step was not applied and no checkpoint"
                " holds it: lower --model.optimizer.lr, keep --model.grad_clip on, or set --model.skip_nonfinite N"
                " to skip up to N bad steps in a row, then resume with --ckpt_path last"
            )
        self.skipped += 1
        rank_zero_warn(f"step {step}: {what}; skipped it ({self.skipped_in_a_row} of {self.skip_limit} in a row)")
        return True


def weights_finite(module: torch.nn.Module, trainer: L.Trainer) -> bool:
    """Whether every parameter and buffer of `module` is finite on every rank (each rank checks its own shards)."""
    tensors = [t.to_local() if hasattr(t, "to_local") else t for t in [*module.parameters(), *module.buffers()]]
    finite = [torch.isfinite(t).all() for t in tensors if t.is_floating_point() and t.numel()]
    device = trainer.strategy.root_device
    bad = (~torch.stack(finite).all()).float().to(device) if finite else torch.zeros((), device=device)
    return float(trainer.strategy.reduce(bad, reduce_op="sum")) == 0


def check_finite_state(state: dict[str, Tensor], source: str) -> None:
    """Refuse a state dict with a non-finite tensor (a checkpoint saved after training diverged)."""
    bad = [
        name
        for name, t in state.items()
        if isinstance(t, Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all())
    ]
    if bad:
        raise CheckpointError(
            f"checkpoint {source} has non-finite weights ({len(bad)} of {len(state)} tensors, first {bad[0]}):"
            " training had diverged when it was saved; use an earlier checkpoint"
        )
