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


HIDDEN = (".attn.q.weight", ".attn.k.weight", ".attn.v.weight", ".attn.o.weight", ".mlp.gate.weight", ".mlp.up.weight",
          ".mlp.down.weight")  # fmt: skip


@pytest.mark.parametrize("residual, tie", [("mhar", False), ("delta-mhar", True), ("hyper-connections", False)])
def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(residual: str, tie: bool) -> None:
    model = Decoder(ModelConfig.preset("tiny", tie_embeddings=tie), residual)
    config = OptimizerConfig(
        name="muon",
        lr=1e-3,
        weight_decay=0.1,
        routing_lr_mult=5.0,
        muon_lr=0.03,
        muon_weight_decay=0.01,
        warmup_steps=0,
    )
    optimizer, _ = build_optimizer(model, config, total_steps=10)
    names = {id(p): n for n, p in model.named_parameters()}

    def named(groups: list[dict]) -> dict[tuple[float, float], set[str]]:
        return {(g["lr"], g["weight_decay"]): {names[id(p)] for p in g["params"]} for g in groups}

    hidden = {n for n in names.values() if n.endswith(HIDDEN)}
    routing = {n for n in names.values() if "residual." in n}
    head = set() if tie else {"head.weight"}
    assert type(optimizer.muon) is torch.optim.Muon and type(optimizer.adamw) is torch.optim.AdamW
    assert named(optimizer.muon.param_groups) == {(0.03, 0.01): hidden}
    assert optimizer.muon.defaults["momentum"] == 0.95 and optimizer.muon.defaults["nesterov"]
    plain = set(names.values()) - hidden - routing - head
    want_adamw = {(1e-3, 0.1): head, (1e-3, 0.0): plain, (5e-3, 0.0): routing}
    assert named(optimizer.adamw.param_groups) == {key: value for key, value in want_adamw.items() if value}
    assert "embed.weight" in plain and any("norm" in n for n in plain) and routing
    assert optimizer.param_groups == [*optimizer.muon.param_groups, *optimizer.adamw.param_groups]


def steps_apart(model: torch.nn.Module, config: OptimizerConfig, batches: list[torch.Tensor]) -> None:
    """The reference: torch's Muon over the 2-D hidden matrices and AdamW over the rest, as torch's documentation
    pairs them, each stepped and scheduled on its own."""
    hidden = [p for n, p in model.named_parameters() if n.endswith(HIDDEN)]
    rest = [p for n, p in model.named_parameters() if not n.endswith(HIDDEN)]
    muon = torch.optim.Muon(hidden, lr=config.muon_lr, weight_decay=config.muon_weight_decay, momentum=0.95)
    adamw = torch.optim.AdamW(rest, lr=config.lr, weight_decay=0.0, betas=config.betas, eps=config.eps)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: lr_factor(s, 10, config)) for o in (muon, adamw)]
    for batch in batches:
        model(batch).logsumexp(-1).mean().backward()
        for optimizer in (muon, adamw):
            optimizer.step()
            optimizer.zero_grad()
        for schedule in schedules:
            schedule.step()


def test_muon_steps_as_torchs_muon_and_adamw_apart_and_resumes_from_its_state_dict() -> None:
    torch.manual_seed(0)
    config = OptimizerConfig(
        name="muon", lr=1e-2, weight_decay=0.0, warmup_steps=2, muon_lr=0.05, muon_weight_decay=0.1
    )
    shape = ModelConfig.preset("tiny", n_layers=2)  # tied: no decayed AdamW group
    reference, model, resumed = Decoder(shape, "sum"), Decoder(shape, "sum"), Decoder(shape, "sum")
    model.load_state_dict(reference.state_dict())
    batches = [torch.randint(0, 256, (2, 16)) for _ in range(4)]
    steps_apart(reference, config, batches)

    optimizer, schedule = build_optimizer(model, config, total_steps=10)
    for step, batch in enumerate(batches):
        if step == 2:  # stop here and go on from a copy of the state, as a resumed run does
            resumed.load_state_dict(model.state_dict())
            saved = optimizer.state_dict(), schedule.state_dict()
            model = resumed
            optimizer, schedule = build_optimizer(model, config, total_steps=10)
            optimizer.load_state_dict(saved[0])
            schedule.load_state_dict(saved[1])
        model(batch).logsumexp(-1).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
    for (name, want), got in zip(reference.state_dict().items(), model.state_dict().values()):
        assert torch.equal(got, want), name


def test_muon_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="optimizer.muon_momentum=1.0 is out of range"):
        OptimizerConfig(name="muon", muon_momentum=1.0)
    with pytest.raises(ValueError, match="muon_adjust_lr='rms': use one of original, match_rms_adamw"):
        OptimizerConfig(muon_adjust_lr="rms")
