"""`mhar evaluate CHECKPOINT --data PREPARED_DIR`: loss, perplexity and bits per byte over a whole split.

Every token of the split is predicted once, from the tokens before it in consecutive windows of the model's length:
the first window starts from an end-of-text token (a split begins a document), each later one from the last token of
the window before, and a last partial window reads as many earlier tokens as fit (lm-evaluation-harness's rolling
log-likelihood, so the two agree on the same text).
Bits per byte divide the summed loss of tokens that stand for text by the UTF-8 bytes they stand for (end-of-text
and other special tokens stand for none), so models with different tokenizers compare.
"""

import json
import math
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from torch import Tensor

from mhar_lightning.arguments import ToolParser
from mhar_lightning.data.shards import TokenStream
from mhar_lightning.data.token_bytes import token_bytes
from mhar_lightning.data.tokenizer import Tokenizer
from mhar_lightning.eval.loading import add_model_options, load_from_args
from mhar_lightning.model import Decoder


@dataclass
class Scores:
    """Totals over a split and the averages that follow from them."""

    tokens: int
    loss_sum: float
    text_loss_sum: float
    bytes: int

    @property
    def loss(self) -> float:
        return self.loss_sum / self.tokens

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 700.0))

    @property
    def bits_per_byte(self) -> float:
        return self.text_loss_sum / math.log(2) / self.bytes if self.bytes else float("nan")

    def to_dict(self) -> dict:
        return {**asdict(self), "loss": self.loss, "perplexity": self.perplexity, "bits_per_byte": self.bits_per_byte}


def windows(targets: np.ndarray, first: int, length: int, batch: int) -> Iterator[tuple[Tensor, Tensor]]:
    """(inputs [B, length], targets [B, n]) batches covering `targets` in order: the inputs are the targets shifted by
    one with `first` in front, and the targets those of the last n input positions. A last partial window comes alone,
    with up to `length` inputs (as much context as fits, like lm-eval's rolling windows)."""

    def shifted(start: int, stop: int) -> Tensor:
        ids = targets[max(start - 1, 0) : stop - 1].astype(np.int64)
        return torch.from_numpy(np.concatenate([[first], ids]) if start == 0 else ids)

    whole = len(targets) // length * length
    for i in range(0, whole, length * batch):
        stop = min(i + length * batch, whole)
        yield shifted(i, stop).view(-1, length), torch.from_numpy(targets[i:stop].astype(np.int64)).view(-1, length)
    if whole < len(targets):
        yield (
            shifted(max(len(targets) - length, 0), len(targets))[None],
            torch.from_numpy(targets[whole:].astype(np.int64))[None],
        )


@torch.inference_mode()
def evaluate_tokens(
    model: Decoder, targets: np.ndarray, bos: int, lengths: Tensor, batch_size: int = 8, progress: bool = True
) -> Scores:
    """Scores of `model` predicting every token of `targets` (see the module doc)."""
    device = model.embed.weight.device
    seq_len = model.config.max_seq_len
    lengths = lengths.to(device)
    loss_sum = text_loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    n_bytes = 0
    bar = Progress(
        TextColumn("evaluating"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tokens"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=not progress,
        transient=True,
    )
    with bar:
        task = bar.add_task("", total=len(targets))
        for inputs, labels in windows(targets, bos, seq_len, batch_size):
            inputs, labels = inputs.to(device), labels.to(device)
            logits = model(inputs)[:, -labels.shape[1] :].float()
            losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").double()
            text = lengths[labels.flatten()]
            loss_sum = loss_sum + losses.sum()
            text_loss_sum = text_loss_sum + losses[text > 0].sum()
            n_bytes += int(text.sum())
            bar.advance(task, labels.numel())
    return Scores(len(targets), float(loss_sum), float(text_loss_sum), n_bytes)


def split_tokens(data: str | Path, split: str, tokenizer: Tokenizer) -> np.ndarray:
    """Every token of `split` of a prepared folder (checked against `tokenizer`), memory-mapped."""
    stream = TokenStream(Path(data), split, tokenizer)
    return stream[0 : len(stream)]


def results_table(scores: Scores, title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for column in ("tokens", "loss (nats)", "perplexity", "bits per byte"):
        table.add_column(column, justify="right")
    table.add_row(f"{scores.tokens:,}", f"{scores.loss:.4f}", f"{scores.perplexity:.3f}", f"{scores.bits_per_byte:.4f}")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(prog="mhar evaluate", description=__doc__.splitlines()[0])
    add_model_options(parser)
    parser.add_argument("--data", type=Path, required=True, help="a folder made by `mhar prepare`")
    parser.add_argument("--split", default="val", help="default: %(default)s")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per forward (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("evaluate.json"), help="JSON results (default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="do not show a progress bar")
    args = parser.parse_args(argv)
    try:
        if args.batch_size < 1:
            raise ValueError(f"--batch-size {args.batch_size}: read at least one window per forward")
        if args.out.is_dir():
            raise ValueError(f"--out {args.out} is a folder: pass a file path, e.g. {args.out / 'evaluate.json'}")
        loaded = load_from_args(args)
        targets = split_tokens(args.data, args.split, loaded.tokenizer)
        lengths = token_bytes(loaded.tokenizer, loaded.model.config.vocab_size)
        scores = evaluate_tokens(
            loaded.model, targets, loaded.tokenizer.eot_id, lengths, args.batch_size, not args.no_progress
        )
    except (ValueError, FileNotFoundError) as error:
        print(f"mhar evaluate: error: {error}", file=sys.stderr)
        return 1
    Console().print(results_table(scores, f"{args.data.name}, split {args.split}"))
    record = {"checkpoint": str(args.checkpoint), "data": str(args.data), "split": args.split, **scores.to_dict()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0
