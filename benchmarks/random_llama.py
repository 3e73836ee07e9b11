"""A Llama-shaped Hugging Face checkpoint with random weights and a tokenizer of its vocabulary size, to run the
mid-training path (convert, FSDP2, resume, consolidate, generate) at a real model's width without its weights.

    python benchmarks/random_llama.py OUT --preset llama3-8b [--layers 8] --corpus DIR

The shape is one of the kit's model presets, with an untied head as Llama 3's. OUT gets `config.json`, bf16
safetensors shards with their index, and a byte-level BPE `tokenizer.json` trained on the text files under `--corpus`
and padded with reserved special tokens to exactly the model's vocabulary, as Llama 3 pads its own. Weights are drawn
N(0, 0.02) (norm gains 1), one tensor at a time, so memory holds one shard.
"""

import argparse
import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mhar_lightning.config import PRESETS, ModelConfig
from mhar_lightning.convert.hf_llama import model_config_to_hf_config

SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>")
RESERVED_SPECIALS = 256
"""Llama 3's vocabulary: 128,000 BPE tokens, then 256 special ones (begin/end of text and reserved tokens)."""
TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".json"}


def write_tokenizer(out: Path, corpus: Path, vocab_size: int) -> Tokenizer:
    """A byte-level BPE `tokenizer.json` of exactly `vocab_size` tokens: trained on `corpus`, then special tokens."""
    files = [str(p) for p in sorted(corpus.rglob("*")) if p.suffix in TEXT_SUFFIXES and p.is_file()]
    if not files:
        raise SystemExit(f"--corpus {corpus}: no {', '.join(sorted(TEXT_SUFFIXES))} files to train a tokenizer on")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = min(RESERVED_SPECIALS, vocab_size // 4)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train(files, trainer)
    reserved = vocab_size - tokenizer.get_vocab_size() - len(SPECIALS)
    tokenizer.add_special_tokens([*SPECIALS, *(f"<|reserved_special_token_{i}|>" for i in range(reserved))])
    tokenizer.save(str(out / "tokenizer.json"))
    names = {"bos_token": SPECIALS[0], "eos_token": SPECIALS[1]}
    (out / "tokenizer_config.json").write_text(json.dumps(names, indent=1) + "\n")
    return tokenizer


def write_weights(out: Path, config: transformers.LlamaConfig, seed: int, shard_bytes: int) -> int:
    """Random bf16 weights in safetensors shards of at most `shard_bytes`, with `model.safetensors.index.json`."""
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in transformers.LlamaForCausalLM(config).state_dict().items()}
    generator = torch.Generator().manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            tensor = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensor = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        if shards[-1] and sum(t.nbytes for t in shards[-1].values()) + tensor.nbytes > shard_bytes:
            shards.append({})
        shards[-1][name] = tensor
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
        total += sum(t.nbytes for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    return sum(t.numel() for shard in shards for t in shard.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="new (or empty) output directory")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b", help="model shape (llama3-8b)")
    parser.add_argument("--layers", type=int, help="transformer blocks (default: the preset's)")
    parser.add_argument("--vocab", type=int, help="vocabulary size (default: the preset's)")
    parser.add_argument("--corpus", type=Path, required=True, help="folder of text files to train the tokenizer on")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--shard-gb", type=float, default=5.0, help="largest safetensors shard in GB")
    args = parser.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"{args.out} is not empty: pass a new directory")
    overrides = {k: v for k, v in {"n_layers": args.layers, "vocab_size": args.vocab}.items() if v is not None}
    try:
        shape = ModelConfig.preset(args.preset, tie_embeddings=False, **overrides)
    except ValueError as error:
        parser.error(str(error))
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = write_tokenizer(args.out, args.corpus, shape.vocab_size)
    tokens = {"bos_token_id": tokenizer.token_to_id(SPECIALS[0]), "eos_token_id": tokenizer.token_to_id(SPECIALS[1])}
    hf_config = model_config_to_hf_config(shape, torch.bfloat16, tokens)
    (args.out / "config.json").write_text(json.dumps(hf_config, indent=1) + "\n")
    config = transformers.LlamaConfig(**hf_config)
    params = write_weights(args.out, config, args.seed, int(args.shard_gb * 1e9))
    print(f"{args.out}: {args.preset} with {shape.n_layers} layers, {params:,} parameters, vocab {shape.vocab_size:,}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
