"""Every recipe parses through its `# base:` chain and instantiates; big models are built on the meta device."""

import functools
import json
from pathlib import Path

import pytest
import torch
import yaml
from cli_helpers import REPO, stand_in_converted
from lightning.pytorch.callbacks import LearningRateMonitor
from mhar_lightning.callbacks import FinalStepCheckpoint

from mhar_lightning.data import datamodule
from mhar_lightning.recipes import recipe_chain
from mhar_lightning.residual import MHAR, AttnRes, HyperConnections, Residual, SumResidual
from mhar_lightning.trainer_cli import MharCLI

RECIPES = REPO / "recipes"
RUNNABLE = sorted(p for p in RECIPES.rglob("*.yaml") if p.name != "base.yaml" and not p.name.startswith("_"))
LEAVES = [p for p in RUNNABLE if p.parent.name in ("pretrain", "sweeps")]
EXPECTED_LEAVES = {
    f"pretrain/{s}-{v}.yaml"
    for s in ("100m", "350m", "1b")
    for v in ("sum", "attnres", "mhar", "mhar-full", "attnres-full")
}
EXPECTED_LEAVES |= {f"pretrain/{s}-hc.yaml" for s in ("100m", "350m")}
EXPECTED_LEAVES |= {f"sweeps/heads-{h}.yaml" for h in (1, 2, 4, 8, 16)}
ONE_DEVICE = (  # one GPU as the recipe's precision asks (the FSDP recipes ask for 8), else the CPU in fp32
    ["--trainer.devices", "1"]
    if torch.cuda.is_available()
    else ["--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.precision", "32-true"]
)


@pytest.fixture(scope="module", autouse=True)
def tokenizers_read_once():
    """The recipes' data modules load a few tokenizers (gpt2 for every pretraining recipe): each is read and its
    rank file verified once for this module, not once per recipe."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(datamodule, "load_tokenizer", functools.cache(datamodule.load_tokenizer))
        yield


CAPTURE_OFF = {"100m-hc.yaml", "350m-hc.yaml", "6m.yaml", "30m.yaml", "100m.yaml"}
"""GPU recipes outside FSDP that leave compiled autograd off: hyper-connections' captured backward compiled too slowly
on the card, and the study trains every method, hyper-connections too, with the same options."""


def user_files(recipe: Path, tmp_path: Path) -> list[str]:
    """Overrides for files a user makes first: the byte tokenizer stands in for a model's tokenizer, and a converted
    directory without weights (`stand_in_converted`) for `model.init_from`."""
    tokenizer = init_from = None
    for path in recipe_chain(recipe):
        config = yaml.safe_load(path.read_text())
        tokenizer = (config.get("data") or {}).get("tokenizer", tokenizer)
        init_from = (config.get("model") or {}).get("init_from", init_from)
    overrides = []
    if tokenizer is not None and "/" in tokenizer and not Path(tokenizer).exists():
        overrides += ["--data.tokenizer", "byte"]
    if init_from is not None and not Path(init_from).exists():
        overrides += ["--model.init_from", str(stand_in_converted(recipe, tmp_path / "converted"))]
    return overrides


def instantiate(recipe: Path, tmp_path: Path, *flags: str) -> MharCLI:
    """Model, data and trainer of `recipe` (and `flags`), as `mhar fit --config recipe` builds them, without running."""
    root = ["--trainer.default_root_dir", str(tmp_path)]
    args = ["--config", str(recipe), *root, *ONE_DEVICE, *user_files(recipe, tmp_path), *flags]
    return MharCLI(args=args, run=False)


def expected_residual(name: str) -> tuple[type, int, int | None]:
    """(class, heads, blocks) that a recipe's file name promises; for hyper-connections (class, rate, dynamic)."""
    if name.startswith("heads-"):
        return MHAR, int(name.removeprefix("heads-")), 8
    variant = name.split("-", 1)[1]
    return {
        "sum": (SumResidual, 0, None),
        "hc": (HyperConnections, 4, True),
        "attnres": (AttnRes, 1, 8),
        "attnres-full": (AttnRes, 1, None),
        "mhar": (MHAR, 8, 8),
        "mhar-full": (MHAR, 8, None),
    }[variant]


def test_every_variant_has_a_recipe() -> None:
    assert {str(p.relative_to(RECIPES)) for p in LEAVES} == EXPECTED_LEAVES


@pytest.mark.parametrize("recipe", LEAVES, ids=lambda p: str(p.relative_to(RECIPES)))
def test_leaf_recipes_hold_only_what_differs(recipe: Path) -> None:
    config = yaml.safe_load(recipe.read_text())
    assert config.keys() == {"trainer", "model"}
    assert config["trainer"].keys() == {"default_root_dir"}
    assert config["model"].keys() == {"residual"} | ({"compiled_autograd"} if recipe.name in CAPTURE_OFF else set())
    assert recipe_chain(recipe)[0] == (RECIPES / "base.yaml").resolve()


@pytest.mark.parametrize("recipe", RUNNABLE, ids=lambda p: str(p.relative_to(RECIPES)))
def test_recipe_instantiates(recipe: Path, tmp_path: Path) -> None:
    cli = instantiate(recipe, tmp_path)
    model, data, trainer = cli.model, cli.datamodule, cli.trainer
    callbacks = {type(c).__name__: c for c in trainer.callbacks}
    assert {"DepthAttentionLogger", "HeadDisagreementProbe", "PeakMemoryMonitor"} <= callbacks.keys()
    assert "TokenThroughputMonitor" in callbacks and "StepProgressBar" in callbacks
    assert any(isinstance(c, LearningRateMonitor) for c in trainer.callbacks)
    assert isinstance(trainer.checkpoint_callback, FinalStepCheckpoint) and trainer.checkpoint_callback.save_last in (
        True,
        "link",
    )
    assert trainer.max_steps > 0
    assert trainer.check_val_every_n_epoch is None  # validation every val_check_interval steps, across epochs
    assert model.model_config.max_seq_len == data.seq_len
    assert model.model_config.vocab_size >= data.vocab_size
    if model.init_from is None:
        assert model.model_config.vocab_size % 64 == 0
    else:  # the converted directory's shape and routing, whatever the recipe's defaults
        stored = json.loads((Path(model.init_from) / "mhar_config.json").read_text())
        assert model.model_config.to_dict() == {**stored["model"], "max_seq_len": data.seq_len}
        assert model.residual.spec()["init_args"] == stored["residual"]["args"]

    captured = recipe.parent.name != "fsdp" and recipe.name not in CAPTURE_OFF
    gpu = recipe.name != "demo.yaml"  # every GPU recipe runs compiled; the CPU demo stays eager
    assert (model.parallel_config.compile, model.compiled_autograd) == (gpu, "auto" if gpu and captured else False)
    if recipe.name == "demo.yaml":
        model.configure_model()
        assert model.decoder.embed.weight.device.type == "cpu"
        return
    if recipe in LEAVES:
        cls, heads, blocks = expected_residual(recipe.stem)
        assert type(model.residual) is cls
        if cls is HyperConnections:
            assert (model.residual.rate, model.residual.dynamic) == (heads, blocks)
        elif cls is not SumResidual:
            assert (model.residual.heads, model.residual.blocks) == (heads, blocks)
        assert model.hparams.preset == ("100m" if recipe.parent.name == "sweeps" else recipe.stem.split("-")[0])
    with torch.device("meta"):
        model.configure_model()
    routing = sum(p.numel() for m in model.decoder.modules() if isinstance(m, Residual) for p in m.parameters())
    assert sum(p.numel() for p in model.decoder.parameters()) - routing == model.model_config.num_params()
    assert all(p.is_meta for p in model.decoder.parameters())


@pytest.mark.parametrize("flag, value", [("name", "muon"), ("schedule", "wsd")])
def test_one_optimizer_flag_keeps_the_recipes_other_optimizer_settings(flag: str, value: str, tmp_path: Path) -> None:
    recipe = RECIPES / "pretrain" / "100m-sum.yaml"
    config = instantiate(recipe, tmp_path, f"--model.optimizer.{flag}", value).model.optimizer_config
    assert getattr(config, flag) == value
    assert (config.lr, config.warmup_steps, config.betas) == (6e-4, 1000, (0.9, 0.95))  # _100m, _pretrain, base
