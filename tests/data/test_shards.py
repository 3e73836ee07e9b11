"""Prepared shards decode back to the input and refuse truncation, corruption and a foreign tokenizer."""

import json
from pathlib import Path

import numpy as np
import pytest
from data_helpers import split_documents

from mhar_lightning.data.prepare import prepare_files
from mhar_lightning.data.shards import INDEX_FILE, ShardError, ShardIndex, TokenStream
from mhar_lightning.data.tokenizer import load_tokenizer

DOCS = [
    "The quick brown fox jumps over the lazy dog.\n",
    "def add(a, b):\n    return a + b\n",
    "# Title\n\nSome *markdown* with ünïcødé and 日本語 😀.\n",
    "<|endoftext|> written literally stays text.\n",
    "x" * 300,
]


def _write_docs(folder: Path) -> list[Path]:
    folder.mkdir()
    files = []
    for i, text in enumerate(DOCS):
        files.append(folder / f"doc{i}.{('txt', 'py', 'md')[i % 3]}")
        files[-1].write_text(text, encoding="utf-8")
    return files


def _prepare(tmp_path: Path, tokenizer: str, **kwargs: object) -> Path:
    out = tmp_path / f"prepared-{tokenizer}"
    prepare_files(_write_docs(tmp_path / f"src-{tokenizer}"), out, load_tokenizer(tokenizer), progress=False, **kwargs)
    return out


@pytest.mark.parametrize("name", ["byte", "gpt2"])
def test_round_trip_decodes_to_the_input(tmp_path: Path, name: str) -> None:
    tok = load_tokenizer(name)
    out = _prepare(tmp_path, name, val_fraction=0.0, shard_tokens=37)  # many shards: reads cross boundaries
    stream = TokenStream(out, "train", tok)
    assert len(stream.shards) > 3
    docs = split_documents(stream, tok)
    assert [tok.decode(d) for d in docs] == DOCS
    assert docs == [tok.encode(text) for text in DOCS]
    index = ShardIndex.load(out)
    assert index.dtype == "uint16" and index.documents == {"train": len(DOCS), "val": 0}
    assert index.tokenizer.name == tok.name and index.tokenizer.vocab_size == tok.vocab_size
    assert stream[5:50].tolist() == np.concatenate([[*d, tok.eot_id] for d in docs])[5:50].tolist()


def test_large_vocabulary_uses_uint32(tmp_path: Path) -> None:
    out = _prepare(tmp_path, "cl100k_base", val_fraction=0.0)
    assert ShardIndex.load(out).dtype == "uint32"
    tok = load_tokenizer("cl100k_base")
    stream = TokenStream(out, "train", tok)
    assert [tok.decode(d) for d in split_documents(stream, tok)] == DOCS


def test_corrupt_shard_is_refused(tmp_path: Path) -> None:
    out = _prepare(tmp_path, "byte", val_fraction=0.0, shard_tokens=64)
    shard = out / "train_00001.bin"
    data = bytearray(shard.read_bytes())
    data[3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=r"train_00001\.bin is corrupt .*mhar prepare"):
        TokenStream(out, "train", load_tokenizer("byte"))


def test_truncated_or_missing_shard_is_refused(tmp_path: Path) -> None:
    out = _prepare(tmp_path, "byte", val_fraction=0.0, shard_tokens=64)
    shard = out / "train_00002.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ShardError, match="truncated"):
        TokenStream(out, "train", load_tokenizer("byte"), verify=False)  # size is checked even without hashing
    shard.unlink()
    with pytest.raises(ShardError, match="missing"):
        TokenStream(out, "train", load_tokenizer("byte"))


def test_other_tokenizer_is_refused(tmp_path: Path) -> None:
    out = _prepare(tmp_path, "byte", val_fraction=0.0)
    with pytest.raises(ShardError, match=r"prepared with tokenizer 'byte' .* but 'r50k_base'"):
        TokenStream(out, "train", load_tokenizer("gpt2"))


def test_broken_index_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ShardError, match="not a prepared folder"):
        ShardIndex.load(tmp_path)
    out = _prepare(tmp_path, "byte", val_fraction=0.0)
    raw = json.loads((out / INDEX_FILE).read_text())
    (out / INDEX_FILE).write_text(json.dumps({**raw, "format": "other/9"}))
    with pytest.raises(ShardError, match="format 'other/9'"):
        ShardIndex.load(out)
    (out / INDEX_FILE).write_text("{")
    with pytest.raises(ShardError, match="unreadable"):
        ShardIndex.load(out)
