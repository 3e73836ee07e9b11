"""Crash-safe checkpoint files: write beside the target, fsync, then atomically rename over it; each records its
content digest."""

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO

from mhar_lightning.checkpoint.digest import with_digest
from mhar_lightning.errors import CheckpointError

TMP_SUFFIX = ".tmp"
STALE_AFTER_S = 300  # a save in progress keeps writing its file; one untouched this long was cut short


class AtomicCheckpointIO(TorchCheckpointIO):
    """`TorchCheckpointIO` whose local saves never leave a partial file at the target path.

    Lightning's own save buffers the whole checkpoint in memory, writes it to a file in the system temp
    folder and moves it into place; when that folder is on another filesystem (a local /tmp, checkpoints on a
    network disk) the move is a copy that a crash can cut short, and nothing is fsynced. Here the temp file
    lives in the target's folder, is fsynced, and `os.replace` swaps it in, so `last.ckpt` is always either
    the previous complete checkpoint or the new one. Every checkpoint records its content digest (`with_digest`),
    which each command that reads it verifies. Remote (fsspec) paths keep Lightning's behaviour.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        checkpoint = with_digest(checkpoint)
        fs = get_filesystem(path)
        if "file" not in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options: remove them from save_checkpoint")
        path = os.path.abspath(os.fspath(path))
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=TMP_SUFFIX, dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; give the usual permissions
            os.replace(tmp, path)
        except BaseException as error:
            if os.path.exists(tmp):
                os.remove(tmp)
            if isinstance(error, (OSError, RuntimeError)):  # torch.save reports a short write as a RuntimeError
                free = shutil.disk_usage(folder).free / 2**20
                raise CheckpointError(
                    f"writing checkpoint {path} failed ({str(error).splitlines()[0]}; {free:.0f} MiB free there):"
                    " free space or choose another --checkpoint.dirpath, then resume with --ckpt_path last"
                    " (the previous checkpoint is intact)"
                ) from error
            raise
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _umask() -> int:
    """The process umask (read by setting it and restoring it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def remove_stale_temporaries(folder: str | Path, stale_after_s: float = STALE_AFTER_S) -> list[Path]:
    """Delete the temporary files of saves that were cut short (e.g. `kill -9` mid-save); returns them."""
    now, removed = time.time(), []
    for path in Path(folder).glob(f".*.ckpt.*{TMP_SUFFIX}"):
        try:
            if now - path.stat().st_mtime > stale_after_s:
                path.unlink()
                removed.append(path)
        except FileNotFoundError:
            continue
    return removed
