"""The content digest a checkpoint records when the kit writes it, and its check whenever a command reads it.

A single-file checkpoint holds `DIGEST_KEY`: a hash of every tensor's bytes, dtype and shape and of every plain value
(steps, hyperparameters), in the order they are stored, so a flipped bit anywhere is found before the weights are
used. A sharded folder holds `DIGEST_FILE`, the hash of each of its files. A checkpoint without a digest (written
before checkpoints recorded one, or by another tool) is read as it is.
"""

import hashlib
import json
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from mhar_lightning.errors import CheckpointError

ALGORITHM = "sha256"
DIGEST_KEY = "content_digest"
DIGEST_FILE = "content_digest.json"
DIGEST_TMP = f".{DIGEST_FILE}.tmp"
OWN_FILES = (DIGEST_FILE, DIGEST_TMP)
CHUNK = 16 * 2**20
MAX_THREADS = 16  # files of a sharded folder hashed at once
PLAIN = (bool, int, float, str, bytes)


def content_digest(checkpoint: Mapping[str, Any], algorithm: str = ALGORITHM) -> str:
    """`algorithm:hex` of everything in `checkpoint` but its recorded digest."""
    hasher = hashlib.new(algorithm)
    _update(hasher, "", {key: value for key, value in checkpoint.items() if key != DIGEST_KEY})
    return f"{algorithm}:{hasher.hexdigest()}"


def _update(hasher: Any, name: str, value: Any) -> None:
    """Feed `value` (nested mappings and sequences of tensors and plain values) to `hasher`, each part with its name."""
    if isinstance(value, Tensor):
        flat = value.detach().cpu().contiguous().reshape(-1)
        hasher.update(f"{name}|{value.dtype}|{tuple(value.shape)}\n".encode())
        hasher.update(flat.view(torch.uint8).numpy())
    elif isinstance(value, Mapping):
        hasher.update(f"{name}|map|{len(value)}\n".encode())
        for key, item in value.items():
            _update(hasher, f"{name}/{_plain(key)}", item)
    elif isinstance(value, (list, tuple)):
        hasher.update(f"{name}|seq|{len(value)}\n".encode())
        for index, item in enumerate(value):
            _update(hasher, f"{name}/{index}", item)
    else:  # another type (a dtype, a device) by its type alone: its repr need not be the same after loading
        hasher.update(f"{name}|{_plain(value)}\n".encode())


def _plain(value: Any) -> str:
    """A plain value as its base type and repr (a `str` subclass reads back as a `str`); another by its type name."""
    if value is None:
        return "None"
    for base in PLAIN:
        if isinstance(value, base):
            return f"{base.__name__}:{base.__repr__(value)}"
    return type(value).__name__


def with_digest(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """`checkpoint` (not changed) with its content digest recorded."""
    return {**checkpoint, DIGEST_KEY: content_digest(checkpoint)}


def verify_digest(checkpoint: Mapping[str, Any], path: str | Path) -> None:
    """Raise `CheckpointError` naming `path` when `checkpoint` differs from the digest it recorded."""
    recorded = checkpoint.get(DIGEST_KEY)
    if recorded is None:
        return
    algorithm = recorded.partition(":")[0] if isinstance(recorded, str) else None
    if algorithm not in hashlib.algorithms_guaranteed or content_digest(checkpoint, algorithm) != recorded:
        raise CheckpointError(changed(path))


def changed(path: str | Path) -> str:
    """The one line for content that differs from its recorded digest."""
    return (
        f"checkpoint {path} differs from the content digest recorded when it was written (damaged on disk or in"
        " transfer, or edited), so it was not loaded: use an intact copy, e.g. an earlier save"
    )


def file_digest(path: Path, algorithm: str = ALGORITHM) -> str:
    """`algorithm:hex` of a file's bytes, read in chunks."""
    hasher = hashlib.new(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            hasher.update(chunk)
    return f"{algorithm}:{hasher.hexdigest()}"


def write_folder_digest(folder: Path, digests: Mapping[str, str]) -> None:
    """Record the digests of a sharded folder's files (name -> `file_digest`) in its `DIGEST_FILE`, atomically."""
    target, tmp = folder / DIGEST_FILE, folder / DIGEST_TMP
    tmp.write_text(json.dumps({"files": dict(sorted(digests.items()))}, indent=1))
    os.replace(tmp, target)


def record_sharded_digest(folder: Path, rank: int) -> None:
    """Record the digest of a sharded checkpoint just written by every rank into `folder` (a collective call).

    Each rank hashes the shard files it wrote (`__RANK_*.distcp`, still in the page cache), so the cost is spread;
    rank 0 also hashes the files only it writes (`.metadata`, `meta.pt`) and writes `DIGEST_FILE`.
    """
    own = {path.name: file_digest(path) for path in folder.glob(f"__{rank}_*.distcp")}
    if rank == 0:
        rest = [p for p in folder.iterdir() if p.is_file() and p.suffix != ".distcp" and p.name not in OWN_FILES]
        own |= {path.name: file_digest(path) for path in rest}
    gathered = [own]
    if dist.is_available() and dist.is_initialized():
        gathered = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, own)
    if rank == 0:
        write_folder_digest(folder, {name: digest for part in gathered for name, digest in part.items()})
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # the record exists before any rank goes on (and e.g. reads the folder)


def verify_folder_digest(folder: Path) -> None:
    """Raise `CheckpointError` naming the file of `folder` that differs from (or is missing from) its record."""
    record = folder / DIGEST_FILE
    if not record.is_file():
        return
    try:
        files = json.loads(record.read_text())["files"]
        names = {name: digest for name, digest in files.items() if isinstance(digest, str)}
    except (ValueError, KeyError, TypeError, AttributeError):
        raise CheckpointError(f"{record} is damaged: use an intact copy of the checkpoint (an earlier save)") from None
    for name, recorded in names.items():
        if Path(name).name != name or name in (".", ".."):
            raise CheckpointError(f"{record} names {name!r}, not a file of its folder: use a checkpoint you trust")
        if not (folder / name).is_file():
            raise CheckpointError(f"{folder / name} is missing from sharded checkpoint {folder}: use an intact copy")
        if recorded.partition(":")[0] not in hashlib.algorithms_guaranteed:
            raise CheckpointError(changed(folder / name))

    def matches(name: str) -> bool:
        return file_digest(folder / name, names[name].partition(":")[0]) == names[name]

    with ThreadPoolExecutor(max_workers=min(len(names), os.cpu_count() or 1, MAX_THREADS) or 1) as pool:
        for name, same in zip(names, pool.map(matches, names)):  # hashlib releases the GIL: files hash in parallel
            if not same:
                raise CheckpointError(changed(folder / name))
