"""A callback that refuses to resume a checkpoint on a different number of ranks, where the data position breaks."""

from typing import Any

import lightning as L


class SameWorldSize(L.Callback):
    """Record the world size in each checkpoint; on resuming training, stop with the fix if it differs.

    Sharded weights and optimizer state could be resharded, but each rank's data loader position is a count of
    its own samples, so on another number of ranks the run would skip or repeat data. Validating or testing a
    checkpoint reads no data position, so any world size may (e.g. one device, a consolidated checkpoint).
    """

    def __init__(self) -> None:
        self.world_size = 1
        self.training = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.world_size = trainer.world_size
        self.training = stage == "fit"

    def state_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict["world_size"]
        if saved != self.world_size and self.training:
            raise RuntimeError(
                f"this checkpoint was written by {saved} ranks and this run has {self.world_size}: resume its training"
                f" with {saved} ranks (devices x num_nodes); validation and `mhar consolidate` take any number"
            )
