"""A callback that refuses to resume a checkpoint on a different number of ranks, where the data position breaks."""

from typing import Any

import lightning as L


class SameWorldSize(L.Callback):
    """Record the world size in each checkpoint; on resume, stop with the fix if it differs.

    Sharded weights and optimizer state could be resharded, but each rank's data loader position is a count of
    its own samples, so on another number of ranks the run would skip or repeat data.
    """

    def __init__(self) -> None:
        self.world_size = 1

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.world_size = trainer.world_size

    def state_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict["world_size"]
        if saved != self.world_size:
            raise RuntimeError(
                f"this checkpoint was written by {saved} ranks and this run has {self.world_size}: resume with"
                f" {saved} ranks (devices x num_nodes), or `mhar consolidate` it and start a new run from the weights"
            )
