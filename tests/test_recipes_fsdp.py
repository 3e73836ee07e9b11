"""The FSDP recipes: the 8B mid-training model is Llama 3 8B plus well under 0.1% of routing parameters."""

from pathlib import Path

import pytest
import torch
import yaml
from cli_helpers import stand_in_converted

from mhar_lightning.memory_plan import memory_plan
from mhar_lightning.module import LanguageModel
from mhar_lightning.parallel import routing_parameter_count, unsharded_parameter_count
from mhar_lightning.recipes import recipe_chain
from mhar_lightning.residual import MHAR, DeltaMHAR

RECIPES = Path(__file__).parents[1] / "recipes" / "fsdp"
LLAMA3_8B_PARAMS = 8_030_261_248  # Meta-Llama-3-8B, untied embedding and head


def merged(recipe: Path) -> dict:
    """The recipe with its `# base:` chain merged in order, as the CLI merges `--config` files."""

    def merge(into: dict, update: dict) -> dict:
        for key, value in update.items():
            into[key] = merge(into.get(key) or {}, value) if isinstance(value, dict) else value
        return into

    config: dict = {}
    for path in recipe_chain(recipe):
        merge(config, yaml.safe_load(path.read_text()) or {})
    return config


def meta_model(recipe: Path, tmp_path: Path) -> LanguageModel:
    model = merged(recipe)["model"]
    if "init_from" in model:  # a converted directory without weights stands in for the user's conversion
        model["init_from"] = str(stand_in_converted(recipe, tmp_path / "converted"))
    with torch.device("meta"):
        module = LanguageModel(**model)
        module.configure_model()  # no trainer: a plain build (init_from is skipped without a trainer)
    return module


def test_midtrain_8b_is_llama3_8b_plus_a_little_routing(tmp_path: Path) -> None:
    module = meta_model(RECIPES / "midtrain-8b.yaml", tmp_path)
    assert isinstance(module.residual, DeltaMHAR) and (module.residual.heads, module.residual.block_size) == (8, 4)
    assert all(p.is_meta for p in module.parameters())
    config = module.model_config
    assert config.num_params() == LLAMA3_8B_PARAMS
    total = unsharded_parameter_count(module.decoder)
    routing = total - LLAMA3_8B_PARAMS
    assert routing == routing_parameter_count(config, module.residual) == 64 * (2 * 4096 + 1) + 4096
    assert routing / LLAMA3_8B_PARAMS < 1e-4  # well under 0.1%
    assert module.optimizer_config.routing_lr_mult > 1
    assert merged(RECIPES / "midtrain-8b.yaml")["model"]["init_from"]


def test_pretrain_1b_recipe_is_sharded_block_mhar(tmp_path: Path) -> None:
    config = merged(RECIPES / "pretrain-1b.yaml")
    assert config["trainer"]["strategy"]["class_path"].endswith("ModelParallelStrategy")
    assert config["trainer"]["precision"] == "32-true" and config["checkpoint"]["save_last"] == "link"
    module = meta_model(RECIPES / "pretrain-1b.yaml", tmp_path)
    assert isinstance(module.residual, MHAR) and (module.residual.heads, module.residual.blocks) == (8, 8)


@pytest.mark.parametrize("recipe", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.stem)
def test_sharded_checkpoints_are_new_directories_that_last_links_to(recipe: Path) -> None:
    """A sharded save writes a directory; Lightning rewrites `last.ckpt` in place (a kill mid-save would mix two
    steps' shards) unless `last` is a link, which it makes only to a kept top-k checkpoint."""
    config = merged(recipe)
    assert config["trainer"]["strategy"]["init_args"]["save_distributed_checkpoint"]
    assert config["checkpoint"]["save_last"] == "link" and config["checkpoint"]["save_top_k"] != 0


@pytest.mark.parametrize(
    ("recipe", "world", "batch", "seq", "limit_gib"), [("pretrain-1b", 8, 4, 2048, 40), ("midtrain-8b", 8, 1, 4096, 80)]
)
def test_memory_plan_fits_an_80gb_gpu(
    recipe: str, world: int, batch: int, seq: int, limit_gib: float, tmp_path: Path
) -> None:
    module = meta_model(RECIPES / f"{recipe}.yaml", tmp_path)
    routing = routing_parameter_count(module.model_config, module.residual)
    checkpointing = module.parallel_config.activation_checkpointing
    plan = memory_plan(module.model_config, world, batch, seq, checkpointing, routing, stream_tensors=2)
    assert plan.total / 2**30 < limit_gib
