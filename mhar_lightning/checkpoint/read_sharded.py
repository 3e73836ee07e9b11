"""Reading sharded (torch.distributed.checkpoint) checkpoints without running code that a checkpoint carries, reading
files outside its folder, or using content that differs from its recorded digest.

torch's `FileSystemReader` unpickles `.metadata` with `pickle.load`, and its default planner loads non-tensor items
with `torch.load(weights_only=False)`, so a planted pickle in a checkpoint directory runs when the directory is
read. Here `.metadata` is unpickled with an allow-list of torch's checkpoint-metadata types, and every non-tensor
item is read with `torch.load(weights_only=True)` before torch (or Lightning) reads the directory. Every file that
`.metadata` names must lie inside the folder, and every file the folder's digest records must match it.
"""

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import BytesStorageMetadata, FileSystemReader, Metadata
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from mhar_lightning.checkpoint.digest import verify_folder_digest
from mhar_lightning.errors import CheckpointError

METADATA_FILE = ".metadata"
META_FILE = "meta.pt"  # loops, schedules and hyperparameters, written by Lightning's ModelParallelStrategy
ALLOWED_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}
"""(module, name) pairs a checkpoint's metadata may name; torch dtypes (`torch.float32`, ...) are allowed too."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles torch's checkpoint metadata and refuses any other global (a class or function to call)."""

    def find_class(self, module: str, name: str) -> Any:
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if not is_dtype and name not in ALLOWED_GLOBALS.get(module, ()):
            raise pickle.UnpicklingError(f"{module}.{name}")
        return super().find_class(module, name)


class SafeFileSystemReader(FileSystemReader):
    """`FileSystemReader` whose `.metadata` is read with `MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / METADATA_FILE
        try:
            with open(path, "rb") as f:
                metadata = MetadataUnpickler(f).load()
        except pickle.UnpicklingError as error:
            raise CheckpointError(
                f"{path} names {error}, which checkpoint metadata never does, so it was not loaded: the directory"
                " was not written by torch.distributed.checkpoint; use a checkpoint you trust"
            ) from None
        except (EOFError, ValueError, TypeError, AttributeError) as error:
            raise CheckpointError(f"{path} is damaged ({error}): use another checkpoint") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not checkpoint metadata")
        check_contained(path, metadata)
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


def check_contained(path: Path, metadata: Metadata) -> None:
    """Refuse metadata (read from `path`) that names a storage file outside its folder (`../..`, an absolute path)."""
    folder = path.parent.resolve()
    for info in (metadata.storage_data or {}).values():
        relative = getattr(info, "relative_path", None)
        if not isinstance(relative, str) or not (folder / relative).resolve().is_relative_to(folder):
            raise CheckpointError(
                f"{path} names the file {relative!r}, outside its folder {path.parent}, so nothing was read: use a"
                " checkpoint you trust (a sharded checkpoint keeps all its files in its folder)"
            )


class _WeightsOnlyItems:
    """The planner side of `read_data` for non-tensor items: each is unpickled with `weights_only=True`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            raise CheckpointError(
                f"item {read_item.dest_index.fqn!r} of the sharded checkpoint is not plain data, so it was not"
                f" loaded ({str(error).splitlines()[0]}): use a checkpoint you trust"
            ) from None


def check_sharded_checkpoint(path: str | Path, verify: bool = True) -> Metadata:
    """Verify `path`'s files against its digest (unless not `verify`), then read its metadata and every non-tensor
    item safely; raises `CheckpointError` on a changed file, a path outside the folder or anything executable."""
    if verify:
        verify_folder_digest(Path(path))
    reader = SafeFileSystemReader(path)
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, is_coordinator=True)
    items = [
        ReadItem(
            type=LoadItemType.BYTE_IO,
            dest_index=MetadataIndex(fqn),
            dest_offsets=torch.Size((0,)),
            storage_index=MetadataIndex(fqn),
            storage_offsets=torch.Size((0,)),
            lengths=torch.Size((0,)),
        )
        for fqn, item in metadata.state_dict_metadata.items()
        if isinstance(item, BytesStorageMetadata)
    ]
    reader.read_data(LoadPlan(items), _WeightsOnlyItems()).wait()
    return metadata


def is_sharded_checkpoint(path: str | Path | None) -> bool:
    """Whether `path` is a sharded checkpoint directory (it holds `.metadata`)."""
    return path is not None and (Path(path) / METADATA_FILE).is_file()
