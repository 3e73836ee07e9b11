"""Reading a single-file Lightning checkpoint: verified against its content digest, with finite weights, or one line
naming the fix."""

import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from mhar_lightning.checkpoint.digest import verify_digest
from mhar_lightning.checkpoint.finite import check_finite_state
from mhar_lightning.checkpoint.read_sharded import is_sharded_checkpoint
from mhar_lightning.errors import CheckpointError


def read_checkpoint(path: str | Path, verify: bool = True) -> dict[str, Any]:
    """The checkpoint at `path`, memory-mapped and read with `weights_only=True`; `CheckpointError` if unusable.

    `verify` checks its content digest and that its weights are finite (a pass over the file);
    only a caller that reads a file verified just before in the same process skips it.
    """
    path = Path(path)
    if is_sharded_checkpoint(path):
        raise CheckpointError(
            f"{path} is a sharded checkpoint directory: merge it into one file with `mhar consolidate {path} OUT.ckpt`"
        )
    if path.is_dir():
        raise CheckpointError(f"{path} is a folder, not a checkpoint: pass a .ckpt file written by `mhar fit`")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist: pass a .ckpt file written by `mhar fit`")
    damaged = f"checkpoint {path} is damaged or not a checkpoint ({{}}): use an intact one, e.g. an earlier save"
    if not zipfile.is_zipfile(path):
        raise CheckpointError(damaged.format("not a complete torch.save archive"))
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, zipfile.BadZipFile, EOFError, KeyError, ValueError) as error:
        raise CheckpointError(damaged.format(str(error).split(". ")[0].strip() or type(error).__name__)) from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise CheckpointError(
            f"{path} is not a Lightning checkpoint (no state_dict): pass a .ckpt written by `mhar fit`"
        )
    if verify:
        verify_digest(checkpoint, path)
        check_finite_state(checkpoint["state_dict"], str(path))
    return checkpoint
