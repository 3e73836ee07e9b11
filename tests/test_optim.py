"""AdamW parameter groups and learning-rate schedules against hand-computed values."""

import math

import pytest
import torch

from mhar_lightning.config import ModelConfig
from mhar_lightning.model import Decoder
from mhar_lightning.optim import OptimizerConfig, Schedule, build_optimizer, lr_factor, parameter_groups


@pytest.mark.parametrize("residual", ["mhar", "delta-mhar"])
def test_only_linear_matrices_decay_and_routing_gets_its_own_lr(residual: str) -> None:
    model = Decoder(ModelConfig.preset("tiny", tie_embeddings=False), residual)
    config = OptimizerConfig(lr=1e-3, weight_decay=0.1, routing_lr_mult=5.0)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = parameter_groups(model, config)
    by_kind = {(g["weight_decay"], g["lr"]): {names[id(p)] for p in g["params"]} for g in groups}

    linear = (".attn.q.", ".attn.k.", ".attn.v.", ".attn.o.", ".mlp.gate.", ".mlp.up.", ".mlp.down.")
    expected_decay = {n for n in names.values() if any(k in f".{n}" for k in linear)} | {"head.weight"}
    expected_routing = {n for n in names.values() if "residual." in n}
    expected_plain = set(names.values()) - expected_decay - expected_routing
    assert by_kind[(0.1, 1e-3)] == expected_decay
    assert by_kind[(0.0, 5e-3)] == expected_routing
    assert by_kind[(0.0, 1e-3)] == expected_plain
    assert "embed.weight" in expected_plain and any("norm" in n for n in expected_plain)
    routing_kinds = {n.rsplit(".", 1)[-1] for n in expected_routing}
    assert routing_kinds == ({"query", "key_norm"} if residual == "mhar" else {"query", "key_norm", "null", "gate"})


def test_tied_embedding_is_one_undecayed_parameter() -> None:
    model = Decoder(ModelConfig.preset("tiny"), "sum")
    groups = parameter_groups(model, OptimizerConfig())
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    no_decay = next(g for g in groups if g["weight_decay"] == 0.0)
    assert any(p is model.embed.weight for p in no_decay["params"])


def cosine(step: int, warmup: int, total: int, floor: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    t = min(1.0, (step - warmup) / (total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))


@pytest.mark.parametrize(
    "step, want",
    [
        (0, 0.1),
        (4, 0.5),
        (9, 1.0),
        (10, 1.0),
        (60, 0.1 + 0.9 * 0.5),
        (85, 0.1 + 0.9 * 0.5 * (1 + math.cos(0.75 * math.pi))),
        (110, 0.1),
        (500, 0.1),
    ],
)
def test_warmup_cosine_by_hand(step: int, want: float) -> None:
    config = OptimizerConfig(warmup_steps=10, min_lr_ratio=0.1, schedule=Schedule.COSINE)
    assert lr_factor(step, 110, config) == pytest.approx(want)
    assert cosine(step, 10, 110, 0.1) == pytest.approx(want)


@pytest.mark.parametrize(
    "step, want",
    [(0, 0.2), (4, 1.0), (50, 1.0), (79, 1.0), (80, 1.0), (90, 1 - 0.9 * 0.5), (95, 1 - 0.9 * 0.75), (100, 0.1)],
)
def test_warmup_stable_decay_by_hand(step: int, want: float) -> None:
    config = OptimizerConfig(warmup_steps=5, min_lr_ratio=0.1, schedule=Schedule.WSD, decay_fraction=0.2)
    assert lr_factor(step, 100, config) == pytest.approx(want)


def test_scheduler_drives_every_group() -> None:
    model = Decoder(ModelConfig.preset("tiny"), "mhar")
    config = OptimizerConfig(lr=2e-3, warmup_steps=4, routing_lr_mult=3.0, min_lr_ratio=0.0)
    optimizer, scheduler = build_optimizer(model, config, total_steps=20)
    seen = []
    for step in range(20):
        seen.append([g["lr"] for g in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    for step, lrs in enumerate(seen):
        factor = cosine(step, 4, 20, 0.0)
        assert lrs == pytest.approx([2e-3 * factor, 2e-3 * factor, 6e-3 * factor])
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["betas"] == (0.9, 0.95)
