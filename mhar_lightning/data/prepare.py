"""``mhar prepare``: tokenize text files into token shards with a deterministic held-out validation split.

Sources are a file or a folder of ``.txt``/``.md``/``.py`` files (one document each), ``.jsonl`` files (one
document per line, taken from a text field) and, when pyarrow is installed, ``.parquet`` files (one document per
row of a text column). Files are read in sorted order; a document goes to validation when its content hash falls
below ``val_fraction``, so the split is stable across runs, machines and file orderings, and identical documents
always land on the same side. A corpus too small for ``val_fraction`` to hold out any document holds out the one of
lowest hash instead, so a validation split exists whenever there are two documents or more.
"""

from __future__ import annotations

import argparse
import errno
import glob
import hashlib
import json
import os
import re
import shutil
import socket
import sys
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from mhar_lightning.data.shards import ShardIndex, ShardWriter, TokenizerInfo, token_dtype
from mhar_lightning.data.tokenizer import Tokenizer, load_tokenizer
from mhar_lightning.processes import process_alive

TEXT_SUFFIXES = frozenset({".txt", ".md", ".py"})
SUFFIXES = TEXT_SUFFIXES | {".jsonl", ".parquet"}
SPLITS = ("train", "val")
_BATCH_CHARS = 1 << 22  # tokenize about 4 MiB of text at a time (tiktoken spreads a batch over threads)
_BUILD_NAME = re.compile(r"\.(?P<out>.+)\.tmp-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{32}")
"""A folder being built, ``.<out>.tmp-<host>-<pid>-<random>``: its host and process tell whether it is abandoned."""


def discover(src: Path) -> list[Path]:
    """Supported files under ``src`` (or ``src`` itself), sorted, skipping hidden files and folders."""
    src = Path(src)
    if src.is_file():
        return [src]
    if not src.is_dir():
        raise FileNotFoundError(
            f"source {src} does not exist: pass a file or a folder of {', '.join(sorted(SUFFIXES))}"
        )
    return sorted(
        path
        for path in src.rglob("*")
        if path.suffix in SUFFIXES
        and path.is_file()
        and not any(part.startswith(".") for part in path.relative_to(src).parts)
    )


def read_documents(path: Path, text_field: str = "text") -> Iterator[str]:
    """The documents of one file: the whole file, each JSONL line's field, or each parquet row's column."""
    if path.suffix in TEXT_SUFFIXES:
        yield path.read_text(encoding="utf-8")
    elif path.suffix == ".jsonl":
        with open(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as error:
                    raise ValueError(
                        f"{path}:{number} is not UTF-8 text ({error.reason} at byte {error.start} of the line):"
                        " re-encode the file as UTF-8, or fix or remove that line"
                    ) from None
                if line.strip():
                    yield jsonl_text(line, text_field, f"{path}:{number}")
    elif path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise ImportError(f"reading {path} needs pyarrow: `pip install pyarrow`") from exc
        parquet = pq.ParquetFile(path)
        if text_field not in parquet.schema_arrow.names:
            raise ValueError(f"{path} has no {text_field!r} column: pass --text-field NAME")
        for batch in parquet.iter_batches(columns=[text_field]):
            yield from (text for text in batch.column(0).to_pylist() if text is not None)
    else:
        raise ValueError(f"unsupported file {path}: use one of {', '.join(sorted(SUFFIXES))}")


def jsonl_text(line: str, text_field: str, where: str) -> str | None:
    """The text of one JSONL line, which must be a JSON object whose ``text_field`` is a string (or null: skipped)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        record = None
    if isinstance(record, dict) and text_field not in record:
        raise ValueError(f"{where} has no {text_field!r} field: pass --text-field NAME")
    if not isinstance(record, dict) or not isinstance(record[text_field], str | None):
        raise ValueError(f"{where} is not a JSON object with a string {text_field!r} field: fix or remove that line")
    return record[text_field]


def document_hash(text: str) -> int:
    """A document's place in the split: the first 8 bytes of its sha256, an integer below 2**64."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


def is_validation(text: str, val_fraction: float) -> bool:
    """Whether a document is held out: its hash, read as a fraction of 2**64, is below ``val_fraction``."""
    return document_hash(text) < val_fraction * 2**64


def prepare_files(
    files: Sequence[Path],
    out: Path,
    tokenizer: Tokenizer,
    *,
    val_fraction: float = 0.01,
    text_field: str = "text",
    shard_tokens: int = 1 << 27,
    overwrite: bool = False,
    progress: bool = True,
    source: str = "",
) -> ShardIndex:
    """Tokenize ``files`` into a new prepared folder ``out``; returns its index.

    The folder is built under a temporary sibling name and renamed into place at the end, so a reader never sees
    a partial folder and concurrent preparations of the same ``out`` cannot mix: the loser gets FileExistsError.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    out = Path(out)
    remove_abandoned_builds(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists: choose another output folder or pass --overwrite")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        args = (files, tokenizer, text_field, shard_tokens, progress)
        index, lowest = _tokenize_into(tmp, *args, val_fraction * 2**64)
        if val_fraction > 0 and index.documents["val"] == 0 and index.documents["train"] >= 2:
            shutil.rmtree(tmp)
            tmp.mkdir()
            index, _ = _tokenize_into(tmp, *args, lowest + 1)  # holds out the document(s) of lowest hash
            index.meta["val_lowest_hash"] = True
        if index.documents["train"] == 0 or (val_fraction > 0 and index.documents["val"] == 0):
            raise ValueError(
                f"{source or 'the source'} gave {index.documents['train']} training and {index.documents['val']}"
                " validation documents: add documents, or pass --val-fraction 0 for no validation split"
            )
        index.meta.update(source=source, val_fraction=val_fraction)
        index.save(tmp)
        _publish(tmp, out, overwrite)
    except OSError as error:
        if error.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise OSError(
            f"the disk of {out.parent} is full ({error.strerror}) while writing {out}: free space there or choose an"
            " output folder on another disk"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return index


def remove_abandoned_builds(out: Path) -> list[Path]:
    """Delete the temporary folders of earlier preparations of ``out`` whose process, on this host, has ended
    (killed mid-way); returns them. A preparation still running, here or on another host, keeps its folder."""
    removed = []
    for path in out.parent.glob(f".{glob.escape(out.name)}.tmp-*") if out.parent.is_dir() else ():
        build = _BUILD_NAME.fullmatch(path.name)
        if build and build["out"] == out.name and build["host"] == socket.gethostname():
            if not process_alive(int(build["pid"])):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def _tokenize_into(
    directory: Path,
    files: Sequence[Path],
    tokenizer: Tokenizer,
    text_field: str,
    shard_tokens: int,
    progress: bool,
    val_below: float,
) -> tuple[ShardIndex, int]:
    """Write the shards of ``files`` into ``directory``, holding out the documents whose hash is below ``val_below``;
    returns their unsaved index and the lowest document hash."""
    dtype = token_dtype(tokenizer.vocab_size)
    writers = {split: ShardWriter(directory, split, dtype, shard_tokens) for split in SPLITS}
    documents = dict.fromkeys(SPLITS, 0)
    skipped = batch_chars = 0
    not_utf8: list[Path] = []
    batch: list[str] = []
    lowest = 2**64

    def flush() -> None:
        nonlocal batch_chars, lowest
        tokens: dict[str, list[int]] = {split: [] for split in SPLITS}
        for text, ids in zip(batch, tokenizer.encode_batch(batch), strict=True):
            place = document_hash(text)
            lowest = min(lowest, place)
            split = "val" if place < val_below else "train"
            tokens[split] += ids
            tokens[split].append(tokenizer.eot_id)
            documents[split] += 1
        for split, ids in tokens.items():
            writers[split].write(np.asarray(ids, dtype=np.int64))
        batch.clear()
        batch_chars = 0

    with _progress_bar(progress) as bar:
        task = bar.add_task(f"tokenizing ({tokenizer.name})", total=sum(path.stat().st_size for path in files))
        for path in files:
            try:
                for text in read_documents(path, text_field):
                    if not text or "\x00" in text:  # empty, or binary masquerading as text
                        skipped += 1
                        continue
                    batch.append(text)
                    batch_chars += len(text)
                    if batch_chars >= _BATCH_CHARS:
                        flush()
            except UnicodeDecodeError:
                if path.suffix not in TEXT_SUFFIXES:
                    raise
                skipped += 1  # a binary or non-UTF-8 text file
                not_utf8.append(path)
            bar.advance(task, path.stat().st_size)
        flush()
    index = ShardIndex(
        tokenizer=TokenizerInfo.of(tokenizer),
        dtype=dtype.name,
        splits={split: writer.close() for split, writer in writers.items()},
        documents=documents,
        meta={"files": len(files), "skipped_documents": skipped, "skipped_not_utf8": [str(path) for path in not_utf8]},
    )
    return index, lowest


def _publish(tmp: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished folder into place (replacing ``out`` only when ``overwrite``)."""
    if overwrite and out.exists():
        shutil.rmtree(out)
    try:
        tmp.rename(out)
    except OSError as exc:
        if out.exists():
            raise FileExistsError(f"{out} was created by another process while preparing") from exc
        raise


def _progress_bar(enabled: bool) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=not enabled,
        transient=True,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``mhar prepare SRC OUT [--tokenizer NAME] ...``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="mhar prepare", description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path, help="a file, or a folder of .txt/.md/.py/.jsonl/.parquet files")
    parser.add_argument("out", type=Path, help="the prepared folder to create")
    parser.add_argument(
        "--tokenizer",
        default="gpt2",
        help="byte, gpt2, r50k_base, cl100k_base, a .tiktoken path, or a model directory (tokenizer.json);"
        " default: gpt2",
    )
    parser.add_argument(
        "--val-fraction", type=float, default=0.01, help="share of documents held out (by hash; default: 0.01)"
    )
    parser.add_argument(
        "--text-field", default="text", help="JSONL field / parquet column holding the text (default: text)"
    )
    parser.add_argument("--shard-tokens", type=int, default=1 << 27, help="tokens per shard file (default: 2^27)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    parser.add_argument("--no-progress", action="store_true", help="do not show a progress bar")
    args = parser.parse_args(argv)
    try:
        tokenizer = load_tokenizer(args.tokenizer)
        index = prepare_files(
            discover(args.src),
            args.out,
            tokenizer,
            val_fraction=args.val_fraction,
            text_field=args.text_field,
            shard_tokens=args.shard_tokens,
            overwrite=args.overwrite,
            progress=not args.no_progress,
            source=str(args.src),
        )
    except (OSError, ValueError, ImportError) as exc:
        print(f"mhar prepare: error: {exc}", file=sys.stderr)
        return 1
    print(
        f"{args.out}: {index.num_tokens('train')} train / {index.num_tokens('val')} val tokens "
        f"({index.documents['train']} / {index.documents['val']} documents, tokenizer {tokenizer.name}, {index.dtype})"
        + skipped_summary(index.meta)
        + (
            f"; --val-fraction {args.val_fraction} held out no document of so small a corpus, so the one of lowest"
            " hash is the validation split"
            if index.meta.get("val_lowest_hash")
            else ""
        )
    )
    return 0


def skipped_summary(meta: dict) -> str:
    """``; skipped N documents (...)`` for the summary line, naming the first text file that was not UTF-8."""
    skipped, not_utf8 = meta["skipped_documents"], meta["skipped_not_utf8"]
    if not skipped:
        return ""
    parts = [f"{skipped - len(not_utf8)} empty or binary"] if skipped > len(not_utf8) else []
    if not_utf8:
        parts.append(f"{len(not_utf8)} text file(s) not UTF-8, first {not_utf8[0]}")
    return f"; skipped {skipped} document(s): {', '.join(parts)}"
