"""The kit's tokenizers as Hugging Face fast tokenizers (`tokenizer.json`), so an export loads with AutoTokenizer.

Byte-level BPE is the common ground: a tiktoken encoding becomes the same ranks as a BPE vocabulary with every merge
that builds a token from two others (as `transformers`' TikTokenConverter does), split by the encoding's own pattern;
the byte tokenizer is that BPE with the 256 bytes and no merges.
"""

import re
from pathlib import Path

from mhar_lightning.convert.safetensors_io import ConversionError
from mhar_lightning.data.tokenizer import ByteTokenizer, Tokenizer


def byte_to_char() -> dict[int, str]:
    """GPT-2's printable stand-in for every byte (byte-level BPE's alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}


def oniguruma(pattern: str) -> str:
    """tiktoken's `pattern` for Oniguruma (Hugging Face's regex engine), which reads `{1,3}+` as a repetition of
    `{1,3}` (tiktoken's possessive quantifiers become greedy ones, which split its patterns' text alike) and `$` as
    the end of a line (tiktoken: of the text, Oniguruma's `\\z`)."""
    return re.sub(r"(?<!\\)\$", r"\\z", re.sub(r"(\{\d+(?:,\d*)?\}|[+*?])\+", r"\1", pattern))


def token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """config.json's token ids: documents end (and, in training, begin) with the end-of-text token."""
    return {"bos_token_id": tokenizer.eot_id, "eos_token_id": tokenizer.eot_id}


def hf_tokenizer(tokenizer: Tokenizer):
    """A `PreTrainedTokenizerFast` that encodes and decodes like `tokenizer` (byte or tiktoken; special-token strings
    in text become their tokens, as usual in `transformers`, where `tokenizer.encode` reads them as text)."""
    try:
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer
        from transformers import PreTrainedTokenizerFast
    except ImportError as error:
        raise ConversionError(f"shipping the tokenizer needs `pip install transformers` ({error})") from error
    chars = byte_to_char()
    if isinstance(tokenizer, ByteTokenizer):
        vocab, merges, pattern, specials = {chars[b]: b for b in range(256)}, [], None, {}
        eos = chars[tokenizer.eot_id]
    elif hasattr(tokenizer, "encoding"):
        encoding = tokenizer.encoding
        ranks: dict[bytes, int] = encoding._mergeable_ranks
        pattern, specials = oniguruma(encoding._pat_str), encoding._special_tokens
        vocab = {"".join(chars[b] for b in token): rank for token, rank in ranks.items()}
        merges = sorted(
            (rank, ranks[token[:i]], ranks[token[i:]], token[:i], token[i:])
            for token, rank in ranks.items()
            for i in range(1, len(token))
            if token[:i] in ranks and token[i:] in ranks
        )
        merges = [("".join(chars[b] for b in left), "".join(chars[b] for b in right)) for *_, left, right in merges]
        vocab |= specials
        eos = next(token for token, i in specials.items() if i == tokenizer.eot_id)
    else:
        raise ConversionError(f"tokenizer {tokenizer.name!r} has no Hugging Face form here; export without it")
    bpe = models.BPE(vocab, merges, fuse_unk=False)
    bpe.ignore_merges = True  # a whole pre-token that is in the vocabulary is one token, as in tiktoken
    backend = HFTokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.pre_tokenizer = (
        byte_level
        if pattern is None
        else pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"), byte_level])
    )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(token, special=True) for token in specials])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos, bos_token=eos)


def save_hf_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    """Write `tokenizer.json` and its companions to `out`."""
    hf_tokenizer(tokenizer).save_pretrained(out)
