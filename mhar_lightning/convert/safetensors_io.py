"""Lazy reading and size-bounded sharded writing of safetensors directories (the Hugging Face layout).

A directory holds either one `model.safetensors` or shards listed in `model.safetensors.index.json`.
Reads are mmap-backed (`safe_open`), so a tensor costs memory only while it is copied or cast; writes
group tensors into shards of at most `max_shard_bytes`, and only one output shard is ever built at a time.
"""

import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from mhar_lightning.contained import inside

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_SHARD_SIZE = "5GB"
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}

log = logging.getLogger(__name__)


class ConversionError(ValueError):
    """A checkpoint that cannot be converted or loaded as asked; the message names the fix."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor to write or load: its final name, shape and dtype, and how to read it (any dtype)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    read: Callable[[], Tensor]

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize

    def load(self, copy: bool = False) -> Tensor:
        """The tensor in `self.dtype`; `copy=True` detaches it from the source file's memory map."""
        return self.read().to(device="cpu", dtype=self.dtype, copy=copy).contiguous()


class SafetensorsDir:
    """The tensors of a safetensors directory, opened lazily and read through memory maps."""

    def __init__(self, path: str | Path, follow_links: bool = True) -> None:
        """Open `path`, whose files must lie inside it: with `follow_links` (the kit's own directories) also where
        symbolic links lead; a Hugging Face cache links every file to a blob outside its snapshot folder."""
        self.path = Path(path)
        self._handles: dict[str, object] = {}
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = dict(json.loads(index.read_text())["weight_map"])
                if not all(isinstance(file, str) for file in weight_map.values()):
                    raise TypeError("weight_map values must be file names")
            except (KeyError, TypeError, ValueError) as error:
                raise ConversionError(
                    f"{index} is unreadable ({error!r}): convert or download the model again"
                ) from None
        elif (self.path / SINGLE_FILE).is_file():
            index, weight_map = self.path / SINGLE_FILE, None
        else:
            raise FileNotFoundError(f"{self.path} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
        self.files: dict[str, Path] = {}
        for name in set(weight_map.values()) if weight_map is not None else {SINGLE_FILE}:
            self.files[name] = inside(self.path, name, follow_links)
            if self.files[name] is None:
                what = f"{index} names {name!r}" if weight_map is not None else f"{index} is a link"
                raise ConversionError(
                    f"{what} that leads outside {self.path}: a model's files must lie in its own directory; convert or"
                    " download the model again"
                )
        if weight_map is None:
            weight_map = dict.fromkeys(self.file(SINGLE_FILE).keys(), SINGLE_FILE)
        self.weight_map: dict[str, str] = weight_map

    def file(self, name: str):
        """The open handle of shard file `name` (opened once)."""
        if name not in self._handles:
            try:
                self._handles[name] = safe_open(self.files[name], framework="pt")
            except SafetensorError as error:  # e.g. a header too large or too small: a damaged or foreign file
                raise ConversionError(
                    f"{self.files[name]} is not a readable safetensors file ({error}): restore it from the source"
                ) from None
        return self._handles[name]

    def names(self) -> list[str]:
        return list(self.weight_map)

    def shape_and_dtype(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """Header facts of tensor `name`, without reading its data."""
        view = self.file(self.weight_map[name]).get_slice(name)
        dtype = view.get_dtype()
        if dtype not in SAFETENSORS_DTYPES:
            raise ConversionError(
                f"tensor {name} in {self.path} has dtype {dtype}; only {', '.join(SAFETENSORS_DTYPES)} load"
            )
        return tuple(view.get_shape()), SAFETENSORS_DTYPES[dtype]

    def tensor(self, name: str) -> Tensor:
        """Tensor `name`, backed by the file's memory map (pages load when touched)."""
        return self.file(self.weight_map[name]).get_tensor(name)


def parse_size(size: str | int) -> int:
    """Bytes in `size`: a positive int or a string such as `5GB`, `500MB`, `2GiB`."""
    example = "write e.g. 5GB, 500MB, 2GiB or a number of bytes"
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([A-Z]*)", size.strip().upper())
        if not match or match[2] not in SIZE_UNITS:
            raise ConversionError(f"cannot read size {size!r}; {example}")
        value = int(float(match[1]) * SIZE_UNITS[match[2]])
    if value < 1:
        raise ConversionError(f"size {size!r} is not a positive number of bytes; {example}")
    return value


def write_sharded(out_dir: Path, entries: Sequence[TensorEntry], max_shard_bytes: int) -> list[str]:
    """Write `entries` as `model.safetensors`, or as numbered shards plus an index when they exceed one shard.

    Tensors of one shard are read (and cast) only while that shard is written.
    """
    shards: list[list[TensorEntry]] = [[]]
    shard_bytes = 0
    for entry in entries:
        if shards[-1] and shard_bytes + entry.nbytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(entry)
        shard_bytes += entry.nbytes
    n = len(shards)
    files = [SINGLE_FILE] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    for i, (file, shard) in enumerate(zip(files, shards), start=1):
        save_file({e.name: e.load() for e in shard}, out_dir / file, metadata={"format": "pt"})
        log.info("[%d/%d] wrote %s (%d tensors, %.2f GB)", i, n, file, len(shard), sum(e.nbytes for e in shard) / 1e9)
    if n > 1:
        index = {
            "metadata": {"total_size": sum(e.nbytes for e in entries)},
            "weight_map": {e.name: file for file, shard in zip(files, shards) for e in shard},
        }
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return files


def check_tensors(where: str, expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]]) -> None:
    """Raise one error listing every missing, unexpected and mis-shaped tensor (name -> shape maps)."""
    missing = [name for name in expected if name not in found]
    unexpected = [name for name in found if name not in expected]
    shapes = [f"{n} {found[n]} (expected {expected[n]})" for n in expected if n in found and found[n] != expected[n]]
    problems = [
        f"{label} {len(names)} tensor(s): {', '.join(names)}"
        for label, names in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", shapes))
        if names
    ]
    if problems:
        raise ConversionError(f"{where}: " + "; ".join(problems))


def fresh_dir(path: str | Path) -> Path:
    """`path` as a new or empty directory, so a write never mixes with stale shards."""
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ConversionError(f"output {path} already exists and is not an empty directory; choose a new one")
    path.mkdir(parents=True, exist_ok=True)
    return path
