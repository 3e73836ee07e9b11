"""On-disk token shards: raw little-endian token arrays plus an ``index.json`` that makes them checkable.

A prepared folder holds ``<split>_<n>.bin`` files (documents concatenated, each followed by the tokenizer's
end-of-text id) and ``index.json`` with the format version, the tokenizer (name, vocab size, EOT id and
fingerprint), the dtype (``uint16`` when the vocabulary fits, else ``uint32``), and per shard its token count and
sha256. Readers check sizes and checksums before training so that a truncated, corrupt or foreign shard is
refused with a clear error instead of silently producing garbage.
"""

from __future__ import annotations

import hashlib
import json
import os
from bisect import bisect_right
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from mhar_lightning.contained import inside
from mhar_lightning.data.tokenizer import Tokenizer
from mhar_lightning.errors import ConfigError

FORMAT = "mhar-shards/1"
INDEX_FILE = "index.json"
_REPREPARE = "re-run `mhar prepare` on the source into a fresh folder"


class ShardError(ConfigError):
    """A prepared folder that cannot be used as is: its message names the fix."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest little-endian unsigned dtype holding every token id."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


@dataclass(frozen=True)
class TokenizerInfo:
    """What identifies the tokenizer a folder was prepared with."""

    name: str
    vocab_size: int
    eot_id: int
    fingerprint: str

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> TokenizerInfo:
        return cls(tokenizer.name, tokenizer.vocab_size, tokenizer.eot_id, tokenizer.fingerprint)


@dataclass(frozen=True)
class ShardInfo:
    """One shard file: its name inside the folder, token count and sha256 of its bytes."""

    file: str
    tokens: int
    sha256: str


@dataclass(frozen=True)
class ShardIndex:
    """The contents of ``index.json``."""

    tokenizer: TokenizerInfo
    dtype: str
    splits: dict[str, list[ShardInfo]]
    documents: dict[str, int]
    meta: dict[str, Any] = field(default_factory=dict)
    format: str = FORMAT

    def num_tokens(self, split: str) -> int:
        return sum(shard.tokens for shard in self.splits.get(split, []))

    def save(self, directory: Path) -> None:
        """Write the index atomically (it is the last file written, so its presence marks a complete folder)."""
        tmp = directory / f"{INDEX_FILE}.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(tmp, directory / INDEX_FILE)

    @classmethod
    def load(cls, directory: Path) -> ShardIndex:
        path = Path(directory) / INDEX_FILE
        if not Path(directory).is_dir():
            raise ShardError(f"data folder {directory} does not exist: pass a folder made by `mhar prepare`")
        if not path.is_file():
            raise ShardError(f"{directory} has no {INDEX_FILE}: it is not a prepared folder; {_REPREPARE}")
        try:
            raw = json.loads(path.read_text())
            if raw.get("format") != FORMAT:
                raise ShardError(f"{path} has format {raw.get('format')!r}, expected {FORMAT!r}; {_REPREPARE}")
            index = cls(
                tokenizer=TokenizerInfo(**raw["tokenizer"]),
                dtype=raw["dtype"],
                splits={k: [ShardInfo(**s) for s in v] for k, v in raw["splits"].items()},
                documents=raw["documents"],
                meta=raw.get("meta", {}),
            )
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ShardError(f"{path} is unreadable ({exc!r}); {_REPREPARE}") from exc
        for shard in (shard for shards in index.splits.values() for shard in shards):
            if inside(directory, shard.file) is None:
                raise ShardError(
                    f"{path} names shard {shard.file!r}, which leads outside {directory}: a prepared folder reads only"
                    f" its own shards; {_REPREPARE}"
                )
        return index

    def check_tokenizer(self, tokenizer: Tokenizer, directory: Path) -> None:
        """Refuse a folder prepared with another tokenizer than ``tokenizer`` (compared by content, not by name)."""
        prepared, requested = self.tokenizer, TokenizerInfo.of(tokenizer)
        if replace(requested, name=prepared.name) != prepared:
            raise ShardError(
                f"{directory} was prepared with tokenizer {prepared.name!r} (vocab {prepared.vocab_size}, "
                f"sha256 {prepared.fingerprint[:12]}) but {requested.name!r} (vocab {requested.vocab_size}, sha256 "
                f"{requested.fingerprint[:12]}) was requested: request the tokenizer the folder was prepared with, "
                "or re-run `mhar prepare` with this one"
            )


class ShardWriter:
    """Append token arrays to ``<split>_<n>.bin`` files of at most ``shard_tokens`` tokens each."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        if shard_tokens <= 0:
            raise ValueError(f"shard_tokens must be positive, got {shard_tokens}")
        self.directory, self.split, self.dtype, self.shard_tokens = Path(directory), split, dtype, shard_tokens
        self.shards: list[ShardInfo] = []
        self._file: Any = None
        self._hash = hashlib.sha256()
        self._count = 0

    def write(self, tokens: np.ndarray) -> None:
        data = np.asarray(tokens).astype(self.dtype, copy=False)
        while data.size:
            if self._file is None:
                name = f"{self.split}_{len(self.shards):05d}.bin"
                self._file = open(self.directory / name, "wb")  # noqa: SIM115 - closed in _finish_shard
            take = data[: self.shard_tokens - self._count]
            chunk = take.tobytes()
            self._file.write(chunk)
            self._hash.update(chunk)
            self._count += take.size
            data = data[take.size :]
            if self._count == self.shard_tokens:
                self._finish_shard()

    def close(self) -> list[ShardInfo]:
        """Finish the last shard and return all shards written."""
        if self._file is not None:
            self._finish_shard()
        return self.shards

    def _finish_shard(self) -> None:
        self._file.close()
        self.shards.append(ShardInfo(Path(self._file.name).name, self._count, self._hash.hexdigest()))
        self._file, self._hash, self._count = None, hashlib.sha256(), 0


class TokenStream:
    """One split's shards as a single memory-mapped token sequence; picklable for dataloader workers."""

    def __init__(self, directory: Path, split: str, tokenizer: Tokenizer, verify: bool = True) -> None:
        """Open ``split`` of a prepared folder after checking tokenizer, sizes and (if ``verify``) checksums."""
        self.directory, self.split = Path(directory), split
        self.index = ShardIndex.load(self.directory)
        self.index.check_tokenizer(tokenizer, self.directory)
        if split not in self.index.splits or not self.index.splits[split]:
            raise ShardError(f"{self.directory} has no {split!r} split; {_REPREPARE} (with a validation fraction > 0)")
        self.dtype = np.dtype(self.index.dtype)
        self.shards = self.index.splits[split]
        for shard in self.shards:
            _check_shard(self.directory, shard, self.dtype, verify, self.index.tokenizer.vocab_size)
        self.offsets = np.cumsum([0] + [s.tokens for s in self.shards]).tolist()
        self._arrays: list[np.memmap] | None = None

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getitem__(self, window: slice) -> np.ndarray:
        """Tokens ``[start, stop)`` of the concatenated split, read across shard boundaries."""
        start, stop, _ = window.indices(len(self))
        arrays = self._open()
        parts = []
        shard = bisect_right(self.offsets, start) - 1
        while start < stop:
            end = min(stop, self.offsets[shard + 1])
            parts.append(arrays[shard][start - self.offsets[shard] : end - self.offsets[shard]])
            start, shard = end, shard + 1
        return np.concatenate(parts) if len(parts) != 1 else np.asarray(parts[0])

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_arrays": None}  # workers reopen the memory maps instead of copying tokens

    def _open(self) -> list[np.memmap]:
        if self._arrays is None:
            self._arrays = [np.memmap(self.directory / s.file, dtype=self.dtype, mode="r") for s in self.shards]
        return self._arrays


def _check_shard(directory: Path, shard: ShardInfo, dtype: np.dtype, verify: bool, vocab_size: int) -> None:
    """Refuse a shard that is missing, of the wrong size, corrupt (if `verify`) or holding an id outside the
    vocabulary (which training would only meet as an index error, mid-run)."""
    path = directory / shard.file
    expected = shard.tokens * dtype.itemsize
    if not path.is_file():
        raise ShardError(f"shard {path} is missing; {_REPREPARE}")
    if (size := path.stat().st_size) != expected:
        raise ShardError(f"shard {path} is truncated or padded ({size} bytes, index says {expected}); {_REPREPARE}")
    digest, largest = scan_shard(path, dtype, verify)
    if verify and digest != shard.sha256:
        raise ShardError(f"shard {path} is corrupt (sha256 differs from {INDEX_FILE}); {_REPREPARE}")
    if largest >= vocab_size:
        raise ShardError(
            f"shard {path} holds token id {largest}, outside the tokenizer's {vocab_size}-token vocabulary;"
            f" {_REPREPARE}"
        )


def scan_shard(path: Path, dtype: np.dtype, digest: bool = True) -> tuple[str | None, int]:
    """The sha256 of a shard's bytes (None unless `digest`) and its largest token id (-1 if empty), in one pass of
    8 MiB blocks."""
    sha, largest = hashlib.sha256() if digest else None, -1
    block_bytes = (8 << 20) // dtype.itemsize * dtype.itemsize
    with open(path, "rb") as f:
        while block := f.read(block_bytes):
            if sha is not None:
                sha.update(block)
            largest = max(largest, int(np.frombuffer(block, dtype=dtype).max()))
    return (sha.hexdigest() if sha is not None else None), largest
