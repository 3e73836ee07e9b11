"""Checks run before the first training step, so that a run never fails late for a reason known at start-up."""

import os
import shutil
from pathlib import Path

from mhar_lightning.config import ModelConfig
from mhar_lightning.errors import ConfigError

CHECKPOINT_BYTES_PER_PARAM = 12  # fp32 weights and AdamW's two fp32 moments


def checkpoint_bytes(config: ModelConfig) -> int:
    """Roughly the size of one training checkpoint of `config` (weights and optimizer state)."""
    return CHECKPOINT_BYTES_PER_PARAM * config.num_params()


def existing_ancestor(path: Path) -> Path:
    """`path` or its nearest existing parent."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_output_dir(path: str | Path, flag: str, needed_bytes: int = 0) -> None:
    """Refuse a folder that cannot be created or written, or whose disk has less than `needed_bytes` free.

    Nothing is created: the nearest existing folder must be writable (a file in the way is named).
    """
    path = Path(path)
    base = existing_ancestor(path)
    if not base.is_dir():
        raise ConfigError(f"{flag} {path} cannot be created: {base} is a file; choose another {flag}")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path} is not writable ({base} denies it); choose another {flag}")
    free = shutil.disk_usage(base).free
    if free < needed_bytes:
        raise ConfigError(
            f"{flag} {path} has {free / 2**20:.0f} MiB free but a checkpoint of this model takes about"
            f" {needed_bytes / 2**20:.0f} MiB: free space or choose another {flag}"
        )
