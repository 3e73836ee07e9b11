"""`environment.json` beside each run's `config.yaml`: the device, the world size and the versions it trained with,
so a result can be traced to its card and software (`mhar compare` reports them per run)."""

import datetime
import importlib.metadata
import json
import platform
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.cli import SaveConfigCallback

ENVIRONMENT_FILE = "environment.json"
PACKAGES = ("mhar-lightning", "torch", "triton", "lightning")


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_environment(trainer: L.Trainer) -> dict[str, Any]:
    """Device name, device count (world size), package versions, Python and the start time (UTC) of `trainer`'s run."""
    device = trainer.strategy.root_device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return {
        "device": name,
        "world_size": trainer.world_size,
        **{package: package_version(package) for package in PACKAGES},
        "python": platform.python_version(),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


class SaveRunConfig(SaveConfigCallback):
    """Lightning's `config.yaml`, and `environment.json` beside it (written by rank 0)."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        first = not self.already_saved
        super().setup(trainer, pl_module, stage)
        if first and self.save_to_log_dir:
            log_dir = trainer.log_dir  # on every rank: it broadcasts rank 0's
            if trainer.is_global_zero and log_dir is not None:
                path = Path(log_dir) / ENVIRONMENT_FILE
                path.write_text(json.dumps(run_environment(trainer), indent=1) + "\n")
