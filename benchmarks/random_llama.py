"""A Llama-shaped Hugging Face checkpoint with random weights and a tokenizer of its vocabulary size, to run the
mid-training path (convert, FSDP2, resume, consolidate, generate) at a real model's width without its weights.

    python benchmarks/random_llama.py OUT --shape llama3-8b [--layers 8] --corpus DIR

OUT gets `config.json`, bf16 safetensors shards with their index, and a byte-level BPE `tokenizer.json` trained on
the text files under `--corpus` and padded with reserved special tokens to exactly the shape's vocabulary, as Llama 3
pads its own. Weights are drawn N(0, 0.02) (norm gains 1), one tensor at a time, so memory holds one shard.
"""

import argparse
import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SHAPES = {
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
    ),
    "tiny": dict(  # for tests: a CPU second
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=640,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
    ),
}
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
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b", help="model shape (llama3-8b)")
    parser.add_argument("--layers", type=int, help="transformer blocks (default: the shape's)")
    parser.add_argument("--corpus", type=Path, required=True, help="folder of text files to train the tokenizer on")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--shard-gb", type=float, default=5.0, help="largest safetensors shard in GB")
    args = parser.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"{args.out} is not empty: pass a new directory")
    args.out.mkdir(parents=True, exist_ok=True)
    shape = SHAPES[args.shape] | ({"num_hidden_layers": args.layers} if args.layers else {})
    tokenizer = write_tokenizer(args.out, args.corpus, shape["vocab_size"])
    vocab = tokenizer.get_vocab_size()
    bos, eos = (tokenizer.token_to_id(token) for token in SPECIALS)
    config = transformers.LlamaConfig(
        **shape, tie_word_embeddings=False, bos_token_id=bos, eos_token_id=eos, architectures=["LlamaForCausalLM"]
    )
    config.save_pretrained(args.out)
    params = write_weights(args.out, config, args.seed, int(args.shard_gb * 1e9))
    print(f"{args.out}: {args.shape} with {shape['num_hidden_layers']} layers, {params:,} parameters, vocab {vocab:,}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
