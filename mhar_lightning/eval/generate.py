"""`mhar generate CHECKPOINT --prompt TEXT`: sample a continuation, streamed to the terminal, with a KV cache."""

import math
import sys
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from mhar_lightning.arguments import ToolParser
from mhar_lightning.eval.loading import add_model_options, load_from_args
from mhar_lightning.kv_cache import KVCache
from mhar_lightning.model import Decoder


def sample(logits: Tensor, temperature: float, top_k: int | None, top_p: float | None, generator) -> Tensor:
    """Next token ids [B] from logits [B, V]: argmax at temperature 0, else top-k / nucleus sampling."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_probs, order = logits.softmax(-1).sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p  # the likelier tokens already hold top_p
        logits = logits.masked_fill(torch.zeros_like(outside).scatter(-1, order, outside), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


def generate(
    model: Decoder,
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    stop: int | None = None,
    use_cache: bool = True,
) -> Iterator[int]:
    """Yield up to `max_new_tokens` token ids after `prompt` (fewer at `max_seq_len` or after `stop`, which is
    yielded). With `use_cache` each step runs the decoder on one token; without, on the whole sequence.

    The prompt and options are checked here, before the first token, so a caller can refuse them before printing.
    """
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    limit = model.config.max_seq_len
    if len(prompt) >= limit:
        raise ValueError(f"the prompt has {len(prompt)} tokens; the model reads at most {limit}: shorten it")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be 0 or more, got {max_new_tokens}")
    if not 0 <= temperature < math.inf:  # NaN too
        raise ValueError(f"temperature must be 0 (greedy) or more, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be 1 or more (the likeliest tokens kept), got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (the probability mass kept), got {top_p}")
    return _decode(model, list(prompt), max_new_tokens, temperature, top_k, top_p, generator, stop, use_cache)


@torch.inference_mode()
def _decode(
    model: Decoder,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
    stop: int | None,
    use_cache: bool,
) -> Iterator[int]:
    """`generate`'s tokens, for checked arguments."""
    limit = model.config.max_seq_len
    device = model.embed.weight.device
    tokens = torch.tensor([prompt], device=device)
    steps = min(max_new_tokens, limit - len(prompt))
    cache = KVCache(model.config, 1, len(prompt) + steps, device, model.embed.weight.dtype) if use_cache else None
    logits = model(tokens, cache)[:, -1]
    for step in range(steps):
        token = sample(logits, temperature, top_k, top_p, generator)
        yield int(token)
        if int(token) == stop or step == steps - 1:
            return
        tokens = torch.cat([tokens, token[:, None]], dim=1)
        logits = model(token[:, None], cache)[:, -1] if use_cache else model(tokens)[:, -1]


def stream_text(ids: Iterator[int], decode) -> Iterator[str]:
    """The text of `ids` piece by piece, holding back a trailing partial UTF-8 character until it completes."""
    seen: list[int] = []
    printed = 0
    for token in ids:
        seen.append(token)
        text = decode(seen)
        end = len(text.rstrip("\ufffd"))
        if end > printed:
            yield text[printed:end]
            printed = end
    text = decode(seen)
    if len(text) > printed:
        yield text[printed:]


def recorded(ids: Iterator[int], produced: list[int], eot: int) -> Iterator[int]:
    """`ids` without end-of-text tokens, each token (end-of-text too) also appended to `produced`."""
    for token in ids:
        produced.append(token)
        if token != eot:
            yield token


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(prog="mhar generate", description=__doc__.splitlines()[0])
    add_model_options(parser)
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="default: %(default)s")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding (default: %(default)s)")
    parser.add_argument("--top-k", type=int, default=200, help="sample from the k likeliest (default: %(default)s)")
    parser.add_argument("--top-p", type=float, help="nucleus sampling: the likeliest tokens of this total mass")
    parser.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    parser.add_argument("--no-cache", action="store_true", help="recompute the whole sequence every step")
    args = parser.parse_args(argv)
    try:
        loaded = load_from_args(args)
        prompt = loaded.tokenizer.encode(args.prompt)
        generator = torch.Generator(loaded.device).manual_seed(args.seed)
        ids = generate(
            loaded.model,
            prompt,
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            generator=generator,
            stop=loaded.tokenizer.eot_id,
            use_cache=not args.no_cache,
        )
        eot = loaded.tokenizer.eot_id
        produced: list[int] = []
        sys.stdout.write(args.prompt)
        for piece in stream_text(recorded(ids, produced, eot), loaded.tokenizer.decode):
            sys.stdout.write(piece)
            sys.stdout.flush()
    except (ValueError, FileNotFoundError) as error:
        print(f"mhar generate: error: {error}", file=sys.stderr)
        return 1
    sys.stdout.write("\n")
    limit = loaded.model.config.max_seq_len
    if len(prompt) + len(produced) == limit and len(produced) < args.max_new_tokens and produced[-1:] != [eot]:
        print(
            f"mhar generate: stopped after {len(produced)} of --max-new-tokens {args.max_new_tokens} tokens: the"
            f" prompt ({len(prompt)} tokens) and the continuation fill the model's context of {limit} tokens",
            file=sys.stderr,
        )
    return 0
