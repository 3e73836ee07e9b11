"""The per-GPU memory plan: sharding divides the optimizer state, checkpointing trades activations for recompute."""

import pytest

from mhar_lightning.config import ModelConfig
from mhar_lightning.memory_plan import memory_plan
from mhar_lightning.parallel import ActivationCheckpointing


def test_memory_plan_shards_states_and_checkpointing_saves_activations() -> None:
    config = ModelConfig.preset("1b")
    one, eight = memory_plan(config, 1, 4, 2048), memory_plan(config, 8, 4, 2048)
    assert one.optimizer == 8 * config.num_params()  # AdamW: two fp32 moments
    assert eight.optimizer == pytest.approx(one.optimizer / 8, rel=1e-6)
    plans = [memory_plan(config, 8, 4, 2048, mode).activations for mode in ActivationCheckpointing]
    assert plans[0] > plans[2] > plans[1]  # none > selective > full
