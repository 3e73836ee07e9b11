"""A small Hugging Face Llama directory made offline: a `tokenizers` BPE `tokenizer.json` of an unusual size and a
`LlamaForCausalLM` trained a little on the same text, saved with `save_pretrained`."""

import json
import os
from pathlib import Path

import torch

os.environ["HF_HUB_OFFLINE"] = "1"
import tokenizers  # noqa: E402 - after HF_HUB_OFFLINE is set
import transformers  # noqa: E402

EOS = "<|endoftext|>"
TOKENIZER_VOCAB = 300  # the trainer's target; what it reaches is below 64 * k and is the model's vocabulary
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly box and juggle zesty plums".split()


def corpus_lines(n: int = 400, seed: int = 0) -> list[str]:
    """`n` short documents of a small, repetitive language, so a tiny model learns it within a few steps."""
    g = torch.Generator().manual_seed(seed)
    lines = []
    for _ in range(n):
        start = int(torch.randint(len(WORDS), (1,), generator=g))
        length = int(torch.randint(6, 14, (1,), generator=g))
        lines.append(" ".join(WORDS[(start + i) % len(WORDS)] for i in range(length)) + ".")
    return lines


def train_tokenizer(out: Path, lines: list[str]) -> tokenizers.Tokenizer:
    """A byte-level BPE `tokenizer.json` (plus a `tokenizer_config.json` naming its EOS) trained on `lines`."""
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=[EOS],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(lines, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    return tokenizer


def trained_llama(out: Path, steps: int = 60, **config) -> transformers.LlamaForCausalLM:
    """A small `LlamaForCausalLM` with its tokenizer in `out`, trained `steps` AdamW steps on `corpus_lines`.

    The model's vocabulary is the tokenizer's exact size (not a multiple of 64); `config` overrides the shape.
    """
    lines = corpus_lines()
    tokenizer = train_tokenizer(out, lines)
    eos = tokenizer.token_to_id(EOS)
    ids = [i for line in lines for i in [*tokenizer.encode(line).ids, eos]]
    shape = {
        "vocab_size": tokenizer.get_vocab_size(),
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6,
        "eos_token_id": eos,
        **config,
    }
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, attn_implementation="eager"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    windows = torch.tensor(ids[: len(ids) // 33 * 33]).view(-1, 33)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        batch = windows[torch.randint(len(windows), (16,), generator=g)]
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval().save_pretrained(out)
    return model


def write_corpus(path: Path) -> Path:
    """`corpus_lines` as a JSONL file, one document a line (what `mhar prepare` reads)."""
    path.write_text("".join(json.dumps({"text": line}) + "\n" for line in corpus_lines()))
    return path
