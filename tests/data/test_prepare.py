"""`mhar prepare`: sources, the deterministic validation split, the CLI, and the cached default corpus."""

import errno
import hashlib
import json
import os
import random
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from data_helpers import split_documents

from mhar_lightning.cli import main as mhar
from mhar_lightning.data import corpus
from mhar_lightning.data.prepare import discover, is_validation, main, prepare_files
from mhar_lightning.data.shards import ShardIndex, ShardWriter, TokenStream
from mhar_lightning.data.tokenizer import load_tokenizer

BYTE = load_tokenizer("byte")
DOCS = [f"document {i}: " + "lorem ipsum " * (i % 7) for i in range(400)]


def _write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def _docs(out: Path, split: str) -> list[str]:
    """The decoded documents of one split of a byte-tokenized folder."""
    return [BYTE.decode(d) for d in split_documents(TokenStream(out, split, BYTE), BYTE)]


def test_validation_split_is_disjoint_complete_and_stable(tmp_path: Path) -> None:
    first = prepare_files(
        [_write_jsonl(tmp_path / "a.jsonl", DOCS)], tmp_path / "a", BYTE, val_fraction=0.1, progress=False
    )
    train, val = _docs(tmp_path / "a", "train"), _docs(tmp_path / "a", "val")
    assert 10 < len(val) < 80 and not set(train) & set(val) and sorted(train + val) == sorted(DOCS)
    # Same input again: byte-identical shards.
    again = prepare_files([tmp_path / "a.jsonl"], tmp_path / "b", BYTE, val_fraction=0.1, progress=False)
    assert again.splits == first.splits
    # Shuffled input: the same documents are held out (the split depends on content, not position).
    shuffled = random.Random(0).sample(DOCS, len(DOCS))
    prepare_files(
        [_write_jsonl(tmp_path / "c.jsonl", shuffled)], tmp_path / "c", BYTE, val_fraction=0.1, progress=False
    )
    assert sorted(_docs(tmp_path / "c", "val")) == sorted(val)


def test_folder_of_mixed_files_and_parquet(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / ".hidden").mkdir()
    (src / "a.txt").write_text("alpha")
    (src / "sub" / "b.md").write_text("beta")
    (src / "c.py").write_text("gamma = 1")
    (src / "skip.bin").write_bytes(b"\x00\x01")
    (src / ".hidden" / "d.txt").write_text("hidden")
    (src / "bad.txt").write_bytes(b"\xff\xfe not utf-8")
    _write_jsonl(src / "e.jsonl", ["delta", "epsilon"])
    pq.write_table(pa.table({"text": ["zeta", None, "eta"]}), src / "f.parquet")
    files = discover(src)
    assert [p.relative_to(src).as_posix() for p in files] == [
        "a.txt",
        "bad.txt",
        "c.py",
        "e.jsonl",
        "f.parquet",
        "sub/b.md",
    ]
    index = prepare_files(files, tmp_path / "out", BYTE, val_fraction=0.0, progress=False)
    assert _docs(tmp_path / "out", "train") == ["alpha", "gamma = 1", "delta", "epsilon", "zeta", "eta", "beta"]
    assert index.meta["skipped_documents"] == 1


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _write_jsonl(tmp_path / "docs.jsonl", DOCS)
    out = tmp_path / "out"
    assert main([str(src), str(out), "--tokenizer", "gpt2", "--val-fraction", "0.05", "--no-progress"]) == 0
    assert "train" in capsys.readouterr().out
    assert ShardIndex.load(out).tokenizer.name == "r50k_base"
    assert main([str(src), str(out), "--no-progress"]) == 1
    assert "already exists" in capsys.readouterr().err
    assert main([str(src), str(out), "--tokenizer", "byte", "--overwrite", "--no-progress"]) == 0
    assert ShardIndex.load(out).tokenizer.name == "byte"
    assert main([str(tmp_path / "absent"), str(tmp_path / "o2")]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert main([str(src), str(tmp_path / "o3"), "--text-field", "body"]) == 1
    assert "no 'body' field" in capsys.readouterr().err
    one = _write_jsonl(tmp_path / "one.jsonl", DOCS[:1])
    assert main([str(one), str(tmp_path / "o4"), "--tokenizer", "byte", "--no-progress"]) == 1
    assert capsys.readouterr().err.endswith(
        "gave 1 training and 0 validation documents: add documents, or pass --val-fraction 0 for no validation split\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl", "one.jsonl", "out"]  # no partial folders


def test_a_small_corpus_holds_out_its_document_of_lowest_hash(tmp_path: Path, capsys) -> None:
    """At the default --val-fraction, 12 documents hash to no validation document; the lowest hash is held out."""
    docs = DOCS[:12]
    assert not any(is_validation(doc, 0.01) for doc in docs)  # what the plain hash split gives
    lowest = min(docs, key=lambda doc: hashlib.sha256(doc.encode()).digest())
    src, out = _write_jsonl(tmp_path / "docs.jsonl", docs), tmp_path / "out"
    with pytest.raises(SystemExit) as done:
        mhar(["prepare", str(src), str(out), "--tokenizer", "byte", "--no-progress"])
    assert done.value.code == 0
    index = ShardIndex.load(out)
    assert index.documents == {"train": 11, "val": 1}
    assert index.num_tokens("val") == len(lowest.encode()) + 1  # its bytes and the end-of-text token
    assert capsys.readouterr().out.strip().endswith(
        "(11 / 1 documents, tokenizer byte, uint16); --val-fraction 0.01 held out no document of so small a corpus,"
        " so the one of lowest hash is the validation split"
    )


@pytest.mark.parametrize("line", ['"a string"', "7", '{"text": 5}', "not json", "[1]"])
def test_a_jsonl_line_without_string_text_is_named_by_file_and_line(tmp_path: Path, capsys, line: str) -> None:
    src = tmp_path / "docs.jsonl"
    src.write_text(f'{{"text": "fine"}}\n\n{line}\n{{"text": "also fine"}}\n')
    assert main([str(src), str(tmp_path / "out"), "--tokenizer", "byte", "--no-progress"]) == 1
    assert capsys.readouterr().err == (
        f"mhar prepare: error: {src}:3 is not a JSON object with a string 'text' field: fix or remove that line\n"
    )


def refused(argv: list[str], capsys) -> str:
    """The one stderr line of `mhar prepare argv`, which must exit 2 having printed nothing else."""
    with pytest.raises(SystemExit) as done:
        mhar(["prepare", *argv, "--tokenizer", "byte", "--no-progress"])
    out, err = capsys.readouterr()
    assert (done.value.code, out, len(err.strip().splitlines())) == (2, "", 1), err
    return err.strip()


def test_a_jsonl_line_that_is_not_utf8_is_named_by_file_and_line(tmp_path: Path, capsys) -> None:
    src = tmp_path / "docs.jsonl"
    src.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    assert refused([str(src), str(tmp_path / "out")], capsys) == (
        f"mhar prepare: error: {src}:2 is not UTF-8 text (invalid continuation byte at byte 13 of the line):"
        " re-encode the file as UTF-8, or fix or remove that line"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl"]


def test_text_files_that_are_not_utf8_are_counted_and_named_in_the_summary(tmp_path: Path, capsys) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i, doc in enumerate(DOCS[:20]):
        (src / f"{i:02d}.txt").write_text(doc)
    (src / "20-latin1.txt").write_bytes("café".encode("latin-1"))
    (src / "21-empty.txt").write_text("")
    assert main([str(src), str(tmp_path / "out"), "--tokenizer", "byte", "--val-fraction", "0.2", "--no-progress"]) == 0
    summary = capsys.readouterr().out.strip()
    assert summary.endswith(
        f"; skipped 2 document(s): 1 empty or binary, 1 text file(s) not UTF-8, first {src / '20-latin1.txt'}"
    )
    index = ShardIndex.load(tmp_path / "out")
    assert sum(index.documents.values()) == 20 and index.meta["skipped_not_utf8"] == [str(src / "20-latin1.txt")]


def test_a_full_disk_is_one_line_naming_the_output_and_leaves_nothing(tmp_path: Path, capsys, monkeypatch) -> None:
    def full(self, tokens) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ShardWriter, "write", full)
    src = _write_jsonl(tmp_path / "docs.jsonl", DOCS)
    out = tmp_path / "data" / "out"
    assert refused([str(src), str(out)], capsys) == (
        f"mhar prepare: error: the disk of {out.parent} is full (No space left on device) while writing {out}: free"
        " space there or choose an output folder on another disk"
    )
    assert list(out.parent.iterdir()) == []


def test_a_prepare_killed_mid_way_leaves_no_temporary_folder_after_the_next(tmp_path: Path) -> None:
    src = _write_jsonl(tmp_path / "docs.jsonl", DOCS)
    out = tmp_path / "out"
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    killed = tmp_path / f".out.tmp-{host}-{int(ended.stdout)}-{'a' * 32}"  # the folder of a process that has ended
    running = tmp_path / f".out.tmp-{host}-{os.getpid()}-{'b' * 32}"  # a preparation still under way
    elsewhere = tmp_path / f".out.tmp-other-host-1-{'c' * 32}"  # one on another machine sharing the disk
    for folder in (killed, running, elsewhere):
        folder.mkdir()
        (folder / "train_00000.bin").write_bytes(b"partial")
    prepare_files([src], out, BYTE, val_fraction=0.1, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["docs.jsonl", "out", running.name, elsewhere.name])


def test_default_corpus_is_cached_and_safe_to_prepare_concurrently() -> None:
    files = corpus.stdlib_files()
    assert files == sorted(files) and any(p.name == "textwrap.py" for p in files)
    assert not any("site-packages" in p.parts or "test" in p.parts for p in files)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(corpus.ensure_corpus(BYTE, progress=False))) for _ in "ab"
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    out = corpus.corpus_dir(BYTE)
    assert results == [out, out]
    assert [p.name for p in corpus.cache_root().iterdir()] == [out.name]  # no temporary folders left
    index = ShardIndex.load(out)
    assert index.documents["val"] > 0 and index.num_tokens("train") > 1_000_000
    stamp = (out / "index.json").stat().st_mtime_ns
    assert corpus.ensure_corpus(BYTE, progress=False) == out and (out / "index.json").stat().st_mtime_ns == stamp
