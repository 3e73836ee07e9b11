"""The optimizer (AdamW, or Muon for the hidden matrices), its parameter groups and learning-rate schedules."""

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any, Literal

import torch
from torch import nn

from mhar_lightning.config import check_fields
from mhar_lightning.muon import MuonAdamW
from mhar_lightning.residual import Residual

MUON_ADJUST_LR = ("original", "match_rms_adamw")
"""`torch.optim.Muon`'s per-shape learning-rate scalings: sqrt(max(1, rows / columns)) (Keller Jordan's), or
0.2 * sqrt(max(rows, columns)), which matches AdamW's update size (Moonshot's)."""


class Schedule(StrEnum):
    """Learning-rate shapes after linear warmup."""

    COSINE = "cosine"
    WSD = "wsd"


class Algorithm(StrEnum):
    """The optimizer: AdamW for every parameter, or Muon for the hidden matrices and AdamW for the rest."""

    ADAMW = "adamw"
    MUON = "muon"


CHOICES = {"name": Algorithm, "schedule": Schedule}
"""Fields that take an enum's value. They are typed as `Literal`s of the values: the command line parses an `Enum`
by its member names (`WSD`), so `--model.optimizer.schedule wsd` fell back to a plain mapping and dropped the
recipe's other optimizer settings."""
NUMBER_FIELDS: dict[str, type | tuple[type, ...]] = {"float": (int, float), "int": int, "tuple": (int, float)}
"""What the numeric fields (by annotation; `tuple`: both betas) must hold before their ranges are checked."""


@dataclass
class OptimizerConfig:
    """The optimizer's hyperparameters and the schedule.

    `name` chooses AdamW or Muon. With Muon, the hidden matrices (attention and MLP projections) take `muon_lr`,
    `muon_weight_decay` and `muon_momentum` (Nesterov), scaled per shape by `muon_adjust_lr`; the embedding, output
    head, norms and routing parameters stay with AdamW at `lr`. `routing_lr_mult` scales the learning rate of
    residual-routing parameters (queries, key gains, gates, null sources); `decay_fraction` is the final share of
    steps that `wsd` spends decaying. The schedule scales every group's learning rate alike.
    """

    name: Literal["adamw", "muon"] = "adamw"
    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    routing_lr_mult: float = 1.0
    warmup_steps: int = 100
    schedule: Literal["cosine", "wsd"] = "cosine"
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2
    muon_lr: float = 0.02
    muon_weight_decay: float = 0.0
    muon_momentum: float = 0.95
    muon_adjust_lr: str = "original"

    def __post_init__(self) -> None:
        for name, choices in CHOICES.items():
            if getattr(self, name) not in set(choices):
                raise ValueError(f"optimizer.{name}={getattr(self, name)!r}: use one of {', '.join(choices)}")
        if self.muon_adjust_lr not in MUON_ADJUST_LR:
            raise ValueError(
                f"optimizer.muon_adjust_lr={self.muon_adjust_lr!r}: use one of {', '.join(MUON_ADJUST_LR)}"
            )
        if not (isinstance(self.betas, (tuple, list)) and len(self.betas) == 2):
            raise ValueError(f"optimizer.betas={self.betas!r}: set --model.optimizer.betas [beta1, beta2]")
        for spec in fields(self):
            value, kind = getattr(self, spec.name), NUMBER_FIELDS.get(str(getattr(spec.type, "__name__", spec.type)))
            values = value if spec.name == "betas" else (value,)
            if kind is not None and not all(isinstance(v, kind) and not isinstance(v, bool) for v in values):
                what = "an integer" if kind is int else "a number"
                raise ValueError(
                    f"optimizer.{spec.name}={value!r} is not {what}: set --model.optimizer.{spec.name} to {what}"
                )
        checks = {
            "lr": self.lr > 0,
            "weight_decay": self.weight_decay >= 0,
            "betas": all(0 <= beta < 1 for beta in self.betas),
            "eps": self.eps > 0,
            "routing_lr_mult": self.routing_lr_mult >= 0,
            "warmup_steps": self.warmup_steps >= 0,
            "min_lr_ratio": 0 <= self.min_lr_ratio <= 1,
            "decay_fraction": 0 < self.decay_fraction <= 1,
            "muon_lr": self.muon_lr > 0,
            "muon_weight_decay": self.muon_weight_decay >= 0,
            "muon_momentum": 0 <= self.muon_momentum < 1,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(
                    f"optimizer.{name}={getattr(self, name)} is out of range: lr, muon_lr and eps > 0, betas and"
                    " muon_momentum in [0, 1), weight_decay, muon_weight_decay, routing_lr_mult and warmup_steps"
                    " >= 0, min_lr_ratio in [0, 1], decay_fraction in (0, 1]"
                )

    @classmethod
    def of(cls, values: "OptimizerConfig | Mapping[str, Any] | None") -> "OptimizerConfig":
        """A config from itself, a mapping of its fields (an unknown key is refused by name) or None (defaults)."""
        if values is None or isinstance(values, cls):
            return values or cls()
        check_fields(values, "model.optimizer", cls)
        return cls(**values)


def parameter_roles(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Every trainable parameter once, in the model's order, with its role: `routing` (a `Residual`'s), `plain`
    (embeddings, norms, biases: anything not a matrix), `head` (the untied output head, `model.head`) or `matrix`
    (the hidden layers' matrices)."""
    routing = {id(p) for m in model.modules() if isinstance(m, Residual) for p in m.parameters()}
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    head = getattr(model, "head", None)
    head = {id(p) for p in head.parameters()} if isinstance(head, nn.Module) else set()
    roles = []
    for param in model.parameters():  # each shared (tied) parameter once
        if not param.requires_grad:
            continue
        if id(param) in routing:
            roles.append(("routing", param))
        elif param.ndim < 2 or id(param) in embeddings:
            roles.append(("plain", param))
        else:
            roles.append(("head" if id(param) in head else "matrix", param))
    return roles


def parameter_groups(model: nn.Module, config: OptimizerConfig) -> list[dict]:
    """AdamW's groups: the matrices of linear layers (hidden and head) decay; embeddings, norms and biases do not;
    routing parameters get their own learning rate and no decay. With Muon, the hidden matrices are left out
    (`muon_groups` holds them) and only the head decays."""
    roles = parameter_roles(model)
    decayed = ("head",) if config.name == Algorithm.MUON else ("head", "matrix")
    groups = [
        {"params": [p for role, p in roles if role in decayed], "weight_decay": config.weight_decay, "lr": config.lr},
        {"params": [p for role, p in roles if role == "plain"], "weight_decay": 0.0, "lr": config.lr},
        {
            "params": [p for role, p in roles if role == "routing"],
            "weight_decay": 0.0,
            "lr": config.lr * config.routing_lr_mult,
        },
    ]
    return [g for g in groups if g["params"]]


def muon_groups(model: nn.Module, config: OptimizerConfig) -> list[dict]:
    """Muon's one group: the hidden matrices, at `muon_lr` and `muon_weight_decay`."""
    params = [p for role, p in parameter_roles(model) if role == "matrix"]
    return [{"params": params, "lr": config.muon_lr, "weight_decay": config.muon_weight_decay}]


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
    """AdamW over `parameter_groups` (and with Muon, `torch.optim.Muon` over `muon_groups`, stepped as one optimizer)
    with a per-step `LambdaLR` schedule."""
    fused = all(p.is_cuda for p in model.parameters())
    adamw = {"lr": config.lr, "betas": config.betas, "eps": config.eps, "fused": fused or None}
    if config.name == Algorithm.MUON:
        muon = {"momentum": config.muon_momentum, "nesterov": True, "adjust_lr_fn": config.muon_adjust_lr}
        optimizer = MuonAdamW(muon_groups(model, config), parameter_groups(model, config), muon, adamw)
    else:
        optimizer = torch.optim.AdamW(parameter_groups(model, config), **adamw)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, config))
    return optimizer, scheduler
