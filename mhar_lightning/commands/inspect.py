"""`mhar inspect CKPT`: depth-attention maps of a trained checkpoint, as a PNG and a table in the terminal."""

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich import box
from rich.console import Console
from rich.table import Table
from torch import Tensor

from mhar_lightning.arguments import ToolParser
from mhar_lightning.callbacks.plots import depth_grid_figure
from mhar_lightning.checkpoint.read_file import read_checkpoint
from mhar_lightning.data.datamodule import TokenDataModule
from mhar_lightning.data.tokenizer import load_tokenizer
from mhar_lightning.probe import DepthMaps, routers_of, run_probe
from mhar_lightning.residual import residual_name
from mhar_lightning.residual.trust import add_residual_option


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ToolParser(
        prog="mhar inspect",
        description="Run a probe batch through a checkpoint and show where each routing site reads from.",
    )
    parser.add_argument("checkpoint", type=Path, help="a Lightning checkpoint written by `mhar fit`")
    parser.add_argument(
        "--out", type=Path, default=Path("depth_attention.png"), help="PNG of the maps (default: %(default)s)"
    )
    parser.add_argument("--text", type=Path, help="probe on this UTF-8 text file instead of the run's validation data")
    parser.add_argument("--rows", type=positive_int, default=8, help="probe sequences (default: %(default)s)")
    parser.add_argument("--seq-len", type=positive_int, help="tokens per sequence (default: the run's)")
    parser.add_argument("--tokenizer", help="tokenizer for --text or the default corpus (default: the run's)")
    parser.add_argument("--npz", type=Path, help="also save the raw weights with their labels here (.npz)")
    add_residual_option(parser)
    args = parser.parse_args(argv)
    for flag, path, suffix in (("--out", args.out, ".png"), ("--npz", args.npz, ".npz")):
        if path is not None and path.suffix.lower() != suffix:  # the writers would append it and print another name
            example = path / f"depth_attention{suffix}" if path.is_dir() else path.with_suffix(suffix)
            parser.error(f"{flag} {path} is not a {suffix} file: name one, e.g. {flag} {example}")
    return args


def text_tokens(path: Path, tokenizer_name: str, seq_len: int, rows: int) -> Tensor:
    """Up to `rows` consecutive windows of `seq_len` tokens of a text file (one shorter row for a short text)."""
    ids = load_tokenizer(tokenizer_name).encode(path.read_text(encoding="utf-8"))
    if not ids:
        raise ValueError(f"{path} holds no text")
    n = max(1, min(rows, len(ids) // seq_len))
    length = min(seq_len, len(ids))
    return torch.tensor(ids[: n * length], dtype=torch.long).view(n, length)


def corpus_tokens(settings: dict[str, Any], tokenizer_name: str, seq_len: int, rows: int) -> Tensor:
    """The first `rows` validation windows of the run's data (the default corpus when the run used it)."""
    data = TokenDataModule(
        path=settings.get("path"), tokenizer=tokenizer_name, seq_len=seq_len, batch_size=rows, val_samples=rows
    )
    data.prepare_data()
    data.setup("validate")
    if data.val_dataset is None:
        raise ValueError(f"{data.data_dir} has no validation split to probe: pass --text FILE (any UTF-8 text)")
    return next(iter(data.val_dataloader()))[:, :-1]


def scalar_columns(scalars: dict[str, np.ndarray]) -> dict[str, list[np.ndarray]]:
    """Per-site scalars grouped into table columns: `name_0 .. name_k` (e.g. a weight per stream) share one."""
    columns: dict[str, list[tuple[int, np.ndarray]]] = {}
    for name, values in scalars.items():
        match = re.fullmatch(r"(.+)_(\d+)", name)
        group, index = (match.group(1), int(match.group(2))) if match else (name, 0)
        columns.setdefault(group, []).append((index, values))
    return {group: [values for _, values in sorted(members, key=lambda m: m[0])] for group, members in columns.items()}


def summary_table(maps: DepthMaps) -> Table:
    """One row per routing site: concentration, embedding/recent weight, top source, head disagreement (with several
    heads), and every scalar the strategy records (a gate; write weights, one per stream, in one column)."""
    depth = {"entropy": maps.entropy(), "emb": maps.embedding_weight(), "recent": maps.recent_weight()}
    heads = {"JS": maps.head_js(), "JS q": maps.query_head_js()} if maps.heads > 1 else {}
    depth, heads = ({name: v for name, v in group.items() if v is not None} for group in (depth, heads))
    caption = " · ".join(
        note
        for name, note in (
            ("entropy", "entropy: nats, mean over heads"),
            ("recent", "emb / recent: head-mean weight on the embedding / the latest source"),
            ("JS", "JS / JS q: mean pairwise JS divergence (bits) between heads, captured / from the trained queries"),
        )
        if name in depth or name in heads
    )
    extra = scalar_columns(maps.scalars)
    table = Table(caption=caption, caption_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("site", no_wrap=True)
    for name in depth:
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("top source")
    for name in [*heads, *extra]:
        table.add_column(name, justify="right", no_wrap=True)
    mean = maps.mean_weights
    for s, label in enumerate(maps.site_labels):
        top = int(np.nanargmax(mean[s]))
        cells = [label, *(f"{v[s]:.3f}" for v in depth.values()), f"{maps.source_labels[top]} ({mean[s, top]:.2f})"]
        cells += [f"{v[s]:.3f}" for v in heads.values()]
        for members in extra.values():
            cells.append(" ".join("" if np.isnan(v[s]) else f"{v[s]:.3g}" for v in members).strip())
        table.add_row(*cells)
    return table


def main(argv: list[str] | None = None) -> int:
    """Entry point of `mhar inspect`; returns the process exit code."""
    args = parse_args(argv)
    console = Console(width=max(120, Console().width))  # a row per site is worth more than fitting 80 columns
    err = Console(stderr=True)
    from mhar_lightning.eval.loading import run_decoder  # here: the eval package imports lm-eval, where installed

    raw = read_checkpoint(args.checkpoint)  # a damaged file or a sharded directory is one line, not a traceback
    model = run_decoder(args.checkpoint, raw)  # the recorded shape: init_from may be gone and is not needed
    if not routers_of(model):
        residual = residual_name(model.final_residual)
        message = f"{args.checkpoint}: residual {residual} has no depth routing to inspect."
        err.print(message, style="red", markup=False, soft_wrap=True)
        return 2
    settings = dict(raw.get("datamodule_hyper_parameters") or {})
    tokenizer = args.tokenizer or settings.get("tokenizer", "byte")
    max_seq_len = model.config.max_seq_len
    seq_len = args.seq_len or settings.get("seq_len") or max_seq_len
    source = str(args.text) if args.text else "validation data of " + (settings.get("path") or "the default corpus")
    try:
        if seq_len > max_seq_len:
            raise ValueError(
                f"--seq-len {seq_len} exceeds the model's max_seq_len: pass --seq-len {max_seq_len} or less"
            )
        tokens = (
            text_tokens(args.text, tokenizer, seq_len, args.rows)
            if args.text
            else corpus_tokens(settings, tokenizer, seq_len, args.rows)
        )
        if int(tokens.max()) >= model.config.vocab_size:
            raise ValueError(
                f"tokenizer {tokenizer!r} yields ids beyond the model's {model.config.vocab_size}-token vocabulary"
            )
    except (OSError, ValueError) as error:
        err.print(f"mhar inspect: {error}", style="red", markup=False, soft_wrap=True)
        return 2
    maps = run_probe(model, tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    depth_grid_figure(maps, f" · {args.checkpoint.name}").savefig(args.out)
    if args.npz:
        maps.save(args.npz)
    console.print(  # paths print whole on one line, to be copied
        f"{args.checkpoint.name}: {maps.heads} head(s), probe {tokens.shape[0]} x {tokens.shape[1]} tokens of {source}",
        soft_wrap=True,
    )
    console.print(summary_table(maps))
    console.print(f"maps written to {args.out}" + (f", raw weights to {args.npz}" if args.npz else ""), soft_wrap=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
