"""AdamW parameter groups and learning-rate schedules for language-model training."""

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
from torch import nn

from mhar_lightning.config import check_fields
from mhar_lightning.residual import Residual


class Schedule(StrEnum):
    """Learning-rate shapes after linear warmup."""

    COSINE = "cosine"
    WSD = "wsd"


@dataclass
class OptimizerConfig:
    """AdamW hyperparameters and the schedule.

    `routing_lr_mult` scales the learning rate of residual-routing parameters (queries, key gains,
    gates, null sources); `decay_fraction` is the final share of steps that `wsd` spends decaying.
    """

    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    routing_lr_mult: float = 1.0
    warmup_steps: int = 100
    schedule: Schedule = Schedule.COSINE
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2

    def __post_init__(self) -> None:
        checks = {
            "lr": self.lr > 0,
            "weight_decay": self.weight_decay >= 0,
            "betas": all(0 <= beta < 1 for beta in self.betas),
            "eps": self.eps > 0,
            "routing_lr_mult": self.routing_lr_mult >= 0,
            "warmup_steps": self.warmup_steps >= 0,
            "min_lr_ratio": 0 <= self.min_lr_ratio <= 1,
            "decay_fraction": 0 < self.decay_fraction <= 1,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(
                    f"optimizer.{name}={getattr(self, name)} is out of range: lr and eps > 0, betas in [0, 1),"
                    " weight_decay, routing_lr_mult and warmup_steps >= 0, min_lr_ratio in [0, 1],"
                    " decay_fraction in (0, 1]"
                )

    @classmethod
    def of(cls, values: "OptimizerConfig | Mapping[str, Any] | None") -> "OptimizerConfig":
        """A config from itself, a mapping of its fields (an unknown key is refused by name) or None (defaults)."""
        if values is None or isinstance(values, cls):
            return values or cls()
        check_fields(values, "model.optimizer", cls)
        return cls(**values)


def parameter_groups(model: nn.Module, config: OptimizerConfig) -> list[dict]:
    """Decay only matrices of linear layers; routing parameters get their own learning rate and no decay."""
    routing = {id(p) for m in model.modules() if isinstance(m, Residual) for p in m.parameters()}
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    decay, no_decay, routed = [], [], []
    seen = set()
    for param in model.parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        if id(param) in routing:
            routed.append(param)
        elif param.ndim < 2 or id(param) in embeddings:
            no_decay.append(param)
        else:
            decay.append(param)
    groups = [
        {"params": decay, "weight_decay": config.weight_decay, "lr": config.lr},
        {"params": no_decay, "weight_decay": 0.0, "lr": config.lr},
        {"params": routed, "weight_decay": 0.0, "lr": config.lr * config.routing_lr_mult},
    ]
    return [g for g in groups if g["params"]]


def lr_factor(step: int, total_steps: int, config: OptimizerConfig) -> float:
    """Multiplier of each group's base learning rate at optimizer step `step`."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    floor = config.min_lr_ratio
    if config.schedule == Schedule.WSD:
        decay_start = total_steps - int(config.decay_fraction * total_steps)
        if step < decay_start:
            return 1.0
        progress = (step - decay_start) / max(1, total_steps - decay_start)
        return 1.0 - (1.0 - floor) * min(1.0, progress)
    progress = min(1.0, (step - config.warmup_steps) / max(1, total_steps - config.warmup_steps))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(
    model: nn.Module, config: OptimizerConfig, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over `parameter_groups` with a per-step `LambdaLR` schedule."""
    fused = all(p.is_cuda for p in model.parameters())
    optimizer = torch.optim.AdamW(
        parameter_groups(model, config), lr=config.lr, betas=config.betas, eps=config.eps, fused=fused or None
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, config))
    return optimizer, scheduler
