"""Stop (or skip) a training step whose loss or gradient norm is not finite, the same way on every rank."""

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.distributed.tensor import DTensor

from mhar_lightning.errors import TrainingDiverged


class NonFiniteGuard:
    """Decides, before each optimizer step, whether the step's loss and gradient norm are finite.

    A bad step is never applied: the run stops with `TrainingDiverged`, so no checkpoint holds it; with `skip_limit`
    > 0 up to that many bad steps in a row are skipped instead and warned about. The decision is all-reduced, so
    every rank of a DDP or FSDP run takes the same one.

    Reading the decision on the host would make every step wait for the GPU. Where the optimizer can skip a step on
    the device (fused Adam/AdamW, through the `found_inf` flag a gradient scaler uses), it does so, and the host reads
    the flags a step or two later from a pinned copy, when they have long arrived: the run then stops (or counts the
    skip) at that later step, naming the bad one. Elsewhere (CPU, other optimizers) the flags are read at once.
    """

    def __init__(self, skip_limit: int = 0) -> None:
        if skip_limit < 0:
            raise ValueError(f"skip_nonfinite={skip_limit} must be >= 0 (0 stops at the first non-finite step)")
        self.skip_limit = skip_limit
        self.skipped_in_a_row = 0
        self.skipped = 0
        self._bad_loss: Tensor | None = None
        self._pending: list[tuple[int, Tensor, torch.cuda.Event]] = []

    def watch_loss(self, loss: Tensor) -> None:
        """Remember whether a micro-batch's loss is finite (no host sync; `check` reads it)."""
        bad = ~torch.isfinite(loss.detach())
        self._bad_loss = bad if self._bad_loss is None else self._bad_loss | bad

    def check(self, trainer: L.Trainer, grad_norm: Tensor, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """True when this step must be skipped here (by dropping its gradients); raises `TrainingDiverged` when the
        run must stop. One all-reduce of three numbers per optimizer step."""
        bad_loss = self._bad_loss if self._bad_loss is not None else torch.zeros((), dtype=torch.bool)
        self._bad_loss = None
        device = grad_norm.device
        bad_norm = ~torch.isfinite(grad_norm)
        flags = torch.stack([bad_loss.to(device), bad_norm]).float()
        flags = trainer.strategy.reduce(flags, reduce_op="sum")
        step = trainer.global_step + 1
        optimizer = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer's torch optimizer
        if flags.is_cuda and skips_on_device(optimizer):
            optimizer.found_inf = (flags.sum() > 0).float()
            host = torch.empty(3, dtype=torch.float32, pin_memory=True)
            host.copy_(torch.cat([flags, grad_norm.detach().float().reshape(1)]), non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending.append((step, host, event))
            self.settle(wait=False)
            return False
        loss_bad, norm_bad = (flags > 0).tolist()
        return self._decide(step, loss_bad, norm_bad, float(grad_norm) if norm_bad else 0.0)

    def settle(self, wait: bool = True) -> None:
        """Decide the earlier steps whose flags have reached the host (all of them with `wait`)."""
        while self._pending:
            step, host, event = self._pending[0]
            if wait:
                event.synchronize()
            elif not event.query():
                return
            self._pending.pop(0)
            loss_bad, norm_bad, norm = host.tolist()
            self._decide(step, loss_bad > 0, norm_bad > 0, norm)

    def _decide(self, step: int, loss_bad: bool, norm_bad: bool, norm: float) -> bool:
        if not (loss_bad or norm_bad):
            self.skipped_in_a_row = 0
            return False
        what = " and ".join(
            [*(["the loss is not finite"] if loss_bad else []), *([f"the gradient norm is {norm}"] if norm_bad else [])]
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


def skips_on_device(optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether `optimizer` skips its step on the device when its `found_inf` flag is set: fused Adam and AdamW over
    plain tensors (FSDP2's sharded parameters are left to the host-side decision)."""
    return (
        isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW)
        and all(group.get("fused") for group in optimizer.param_groups)
        and not any(isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"])
    )


def weights_finite(module: torch.nn.Module, trainer: L.Trainer) -> bool:
    """Whether every parameter and buffer of `module` is finite on every rank (each rank checks its own shards)."""
    return tensors_finite([*module.parameters(), *module.buffers()], trainer)


def tensors_finite(tensors: list[Tensor], trainer: L.Trainer) -> bool:
    """Whether every floating-point tensor of `tensors` is finite on every rank (each rank checks its own shards)."""
    tensors = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    finite = [torch.isfinite(t).all() for t in tensors if t.is_floating_point() and t.numel()]
    device = trainer.strategy.root_device
    bad = (~torch.stack(finite).all()).float().to(device) if finite else torch.zeros((), device=device)
    return float(trainer.strategy.reduce(bad, reduce_op="sum")) == 0
