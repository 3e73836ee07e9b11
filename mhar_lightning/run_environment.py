"""`environment.json` beside each run's `config.yaml`: the device, the world size and the versions it trained with,
so a result can be traced to its card and software (`mhar compare` reports them per run)."""

import datetime
import hashlib
import importlib.metadata
import json
import platform
from collections.abc import Iterable
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


def source_fingerprint(folders: Iterable[str | Path]) -> str:
    """The first 12 hex digits of a sha256 over the `.py` files under `folders` (relative paths and contents): it
    tells apart runs of one version number whose code differed (a source checkout between commits)."""
    digest = hashlib.sha256()
    for folder in map(Path, folders):
        for path in sorted(folder.rglob("*.py")):
            digest.update(f"{folder.name}/{path.relative_to(folder).as_posix()}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def kit_folders() -> list[str]:
    """The folders the installed kit's modules load from (`kernels` and `callbacks` may live apart from it)."""
    import mhar_lightning
    import mhar_lightning.callbacks
    import mhar_lightning.kernels

    return [*mhar_lightning.__path__, *mhar_lightning.kernels.__path__, *mhar_lightning.callbacks.__path__]


def run_environment(trainer: L.Trainer) -> dict[str, Any]:
    """Device name, device count (world size), package versions, the kit's source fingerprint, Python and the start
    time (UTC) of `trainer`'s run."""
    device = trainer.strategy.root_device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return {
        "device": name,
        "world_size": trainer.world_size,
        **{package: package_version(package) for package in PACKAGES},
        "source": source_fingerprint(kit_folders()),
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
