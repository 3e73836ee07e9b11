"""`mhar compare`: train one small model per residual strategy on the same data and seed, then tabulate them."""

import argparse
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from rich.console import Console
from rich.table import Table

from mhar_lightning.cli import padded_vocab
from mhar_lightning.data import TokenDataModule
from mhar_lightning.module import LanguageModel
from mhar_lightning.optim import OptimizerConfig
from mhar_lightning.residual import Residual

STRATEGIES: dict[str, dict[str, Any] | str] = {
    "sum": "sum",
    "attnres-block": {"class_path": "mhar_lightning.residual.AttnRes", "init_args": {"blocks": 4}},
    "attnres-full": {"class_path": "mhar_lightning.residual.AttnRes", "init_args": {"blocks": None}},
    "mhar-block": {"class_path": "mhar_lightning.residual.MHAR", "init_args": {"heads": 4, "blocks": 4}},
    "mhar-full": {"class_path": "mhar_lightning.residual.MHAR", "init_args": {"heads": 4, "blocks": None}},
    "delta-mhar": {"class_path": "mhar_lightning.residual.DeltaMHAR", "init_args": {"heads": 4, "block_size": 1}},
    "hyper-connections": "hyper-connections",
}
"""Strategies compared by default; blocks and heads sized for the `tiny` preset (4 layers, d = 64)."""


@dataclass
class Result:
    name: str
    routing_params: int
    val_loss: float
    tokens_per_sec: float


class StepTimer(L.Callback):
    """Wall time of the training steps after the first `skip` ones (which include one-off warm-up costs)."""

    def __init__(self, skip: int) -> None:
        self.skip = skip
        self.start: float | None = None
        self.steps = 0
        self.seconds = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.skip:
            self.start = time.perf_counter()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.start is not None:
            self.seconds = time.perf_counter() - self.start
            self.steps = trainer.global_step - self.skip


def train_one(name: str, spec: dict[str, Any] | str, args: argparse.Namespace) -> Result:
    """Train `spec` for `args.steps` steps from seed `args.seed` and validate it on the fixed validation windows."""
    data = TokenDataModule(
        tokenizer=args.tokenizer,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        seed=args.seed,
        val_samples=args.val_samples,
    )
    L.seed_everything(args.seed, verbose=False)
    model = LanguageModel(
        preset=args.preset,
        residual=spec,
        vocab_size=padded_vocab(data.vocab_size),
        seq_len=args.seq_len,
        optimizer=OptimizerConfig(lr=args.lr, warmup_steps=max(1, args.steps // 10)),
    )
    timer = StepTimer(skip=min(5, args.steps - 1))
    precision = "bf16-mixed" if args.accelerator != "cpu" and torch.cuda.is_available() else "32-true"
    quiet = {
        "accelerator": args.accelerator,
        "devices": 1,
        "precision": precision,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "use_distributed_sampler": False,
    }
    trainer = L.Trainer(
        max_steps=args.steps, limit_val_batches=0, enable_checkpointing=False, callbacks=[timer], **quiet
    )
    trainer.fit(model, datamodule=data)
    val_loss = L.Trainer(**quiet).validate(model, datamodule=data, verbose=False)[0]["val/loss"]
    routing = sum(p.numel() for m in model.decoder.modules() if isinstance(m, Residual) for p in m.parameters())
    tokens = timer.steps * args.batch_size * args.seq_len
    return Result(name, routing, val_loss, tokens / timer.seconds if timer.seconds else math.nan)


def table(results: list[Result], args: argparse.Namespace) -> Table:
    """A rich table of the results, with val-loss differences and speed relative to the first strategy."""
    base = results[0]
    title = (
        f"{args.preset} model, {args.steps} steps x {args.batch_size} x {args.seq_len} {args.tokenizer} tokens, "
        f"seed {args.seed}; validation on {args.val_samples} windows"
    )
    out = Table(title=title)
    for column in ("strategy", "routing params", "val loss", "val ppl", f"vs {base.name}", "tokens/s", "speed"):
        out.add_column(column, justify="left" if column == "strategy" else "right", no_wrap=True)
    for r in results:
        out.add_row(
            r.name,
            f"{r.routing_params:,}",
            f"{r.val_loss:.4f}",
            f"{math.exp(r.val_loss):.2f}",
            f"{r.val_loss - base.val_loss:+.4f}",
            f"{r.tokens_per_sec:,.0f}",
            f"{r.tokens_per_sec / base.tokens_per_sec:.2f}x",
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mhar compare", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--strategies",
        nargs="+",
        default=list(STRATEGIES),
        choices=list(STRATEGIES),
        help="which to train (the first is the baseline)",
    )
    parser.add_argument("--preset", default="tiny", help="model size preset (default: tiny)")
    parser.add_argument("--tokenizer", default="byte", help="tokenizer of the default standard-library corpus")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per strategy")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (warmup 10%%, then cosine)")
    parser.add_argument("--val-samples", type=int, default=256, help="validation windows")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--accelerator", default="auto", help="auto, cpu or gpu")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2")
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    console = Console(width=max(100, Console().width))
    results = []
    for name in args.strategies:
        console.print(f"training [bold]{name}[/bold] ...")
        results.append(train_one(name, STRATEGIES[name], args))
    console.print(table(results, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
