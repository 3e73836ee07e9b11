"""UTF-8 bytes per token id: the denominator of bits per byte, which compares models with different tokenizers."""

import json
import re

import tokenizers
import torch
from torch import Tensor

from mhar_lightning.data.tokenizer import ByteTokenizer, Tokenizer


def token_bytes(tokenizer: Tokenizer, vocab_size: int) -> Tensor:
    """UTF-8 bytes each token id stands for [vocab_size] (0 for end-of-text, special and unused ids)."""
    lengths = torch.zeros(vocab_size, dtype=torch.long)
    encoding = getattr(tokenizer, "encoding", None)
    if isinstance(tokenizer, ByteTokenizer):
        lengths[: tokenizer.vocab_size] = 1
    elif encoding is not None:  # tiktoken: a token's bytes, which may be part of one character
        special = encoding.special_tokens_set
        for i in range(tokenizer.vocab_size):
            try:
                piece = encoding.decode_single_token_bytes(i)
            except KeyError:  # an id between the ranks and the special tokens
                continue
            lengths[i] = 0 if piece.decode("utf-8", "replace") in special else len(piece)
    else:
        lengths[: tokenizer.vocab_size] = torch.tensor(hf_token_bytes(tokenizer.tokenizer))
    lengths[tokenizer.eot_id] = 0
    return lengths


def hf_token_bytes(tokenizer: tokenizers.Tokenizer) -> list[int]:
    """UTF-8 bytes of each id of a Hugging Face tokenizer (0 for special tokens and unused ids), exact for tokens
    that are part of a character: a byte-level BPE token's characters each stand for one byte, a byte-fallback
    `<0xNN>` token for one, and any other token for what it adds to the decoded text after an ordinary token (a
    word-start marker counts as the space it decodes to)."""
    spec = json.loads(tokenizer.to_str())
    decoder = spec.get("decoder") or {}
    byte_level = "ByteLevel" in {decoder.get("type"), *(d.get("type") for d in decoder.get("decoders") or [])}
    byte_fallback = bool((spec.get("model") or {}).get("byte_fallback"))
    added = tokenizer.get_added_tokens_decoder()
    anchor = tokenizer.encode("a", add_special_tokens=False).ids
    anchor_bytes = len(tokenizer.decode(anchor, skip_special_tokens=False).encode())
    lengths = []
    for i in range(max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1):
        piece = tokenizer.id_to_token(i)
        if piece is None or (i in added and added[i].special):
            lengths.append(0)
        elif i in added:
            lengths.append(len(added[i].content.encode()))
        elif byte_level:
            lengths.append(len(piece))
        elif byte_fallback and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
            lengths.append(1)
        else:
            lengths.append(len(tokenizer.decode([*anchor, i], skip_special_tokens=False).encode()) - anchor_bytes)
    return lengths
