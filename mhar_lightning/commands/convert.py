"""`mhar convert-hf` and `mhar export-hf`: argparse front ends of `save_converted` and `export_hf`."""

import argparse
import logging
import sys
from collections import Counter
from pathlib import Path

import yaml

from mhar_lightning.checkpoint.read_file import read_checkpoint
from mhar_lightning.convert.checkpoint import CONFIG_FILE, save_converted
from mhar_lightning.convert.export import export_hf, export_training_checkpoint
from mhar_lightning.convert.safetensors_io import DEFAULT_SHARD_SIZE, ConversionError, parse_size
from mhar_lightning.data.tokenizer import load_tokenizer
from mhar_lightning.dtypes import DTYPES
from mhar_lightning.residual import RESIDUALS
from mhar_lightning.residual.trust import add_residual_option

RESIDUAL_FLAGS = ("heads", "block_size", "blocks")


def shard_size(text: str) -> int:
    """An argparse type: a positive size in bytes, such as 5GB or 500MB."""
    try:
        return parse_size(text)
    except ConversionError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def key_values(text: str) -> dict:
    """An argparse type: `rate=2,dynamic=false` as `{"rate": 2, "dynamic": False}` (values read as YAML)."""
    pairs = [item.partition("=") for item in filter(None, text.split(","))]
    if not pairs or not all(key and eq for key, eq, _ in pairs):
        raise argparse.ArgumentTypeError(f"write {text!r} as KEY=VALUE pairs, e.g. rate=2,dynamic=false")
    return {key.strip(): yaml.safe_load(value) for key, _, value in pairs}


def add_output_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="cast the weights (default: keep the source dtype)")
    parser.add_argument(
        "--max-shard-size",
        type=shard_size,
        default=DEFAULT_SHARD_SIZE,
        help="largest output shard, e.g. 5GB, 500MB (default: 5GB)",
    )


def run(prog: str, action) -> int:
    """Run `action`, turning expected failures into one `prog: error: ...` line and exit status 1."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        action()
    except (ValueError, FileNotFoundError) as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """`mhar convert-hf SRC OUT --residual delta-mhar --heads 8 --block-size 4`."""
    parser = argparse.ArgumentParser(
        prog="mhar convert-hf",
        description="Convert a local Hugging Face Llama checkpoint (config.json + safetensors) into an "
        "mhar-lightning checkpoint, streaming shard by shard; no network.",
    )
    parser.add_argument("src", help="directory with config.json and model.safetensors or a sharded index")
    parser.add_argument("out", help="new (or empty) output directory")
    parser.add_argument(
        "--residual", default="delta-mhar", choices=sorted(RESIDUALS), help="residual strategy (default: delta-mhar)"
    )
    parser.add_argument("--heads", type=int, help="routing heads (mhar, delta-mhar)")
    parser.add_argument("--block-size", type=int, help="transformer blocks per routed block (delta-mhar)")
    parser.add_argument("--blocks", type=int, help="number of routed blocks (mhar, attnres)")
    parser.add_argument(
        "--residual-args",
        type=key_values,
        default={},
        metavar="KEY=VALUE,...",
        help="any other arguments of the strategy, e.g. rate=2,dynamic=false (hyper-connections)",
    )
    add_output_options(parser)
    args = parser.parse_args(argv)
    residual_args = {flag: getattr(args, flag) for flag in RESIDUAL_FLAGS if getattr(args, flag) is not None}
    for key in residual_args.keys() & args.residual_args.keys():
        parser.error(f"--residual-args sets {key}, and so does --{key.replace('_', '-')}: give it once")
    residual_args |= args.residual_args
    dtype = DTYPES.get(args.dtype)
    return run(
        parser.prog,
        lambda: save_converted(
            args.src, args.out, args.residual, dtype=dtype, max_shard_size=args.max_shard_size, **residual_args
        ),
    )


def stored_dtype(path: str | Path) -> str:
    """The name of the dtype that holds most of the weights of checkpoint file `path` (float32 for a directory)."""
    if not Path(path).is_file():
        return "float32"
    sizes = Counter()
    for tensor in read_checkpoint(path)["state_dict"].values():
        if tensor.is_floating_point():
            sizes[tensor.dtype] += tensor.numel()
    names = {dtype: name for name, dtype in DTYPES.items()}
    return names.get(max(sizes, key=sizes.get, default=None), "float32")


def export_main(argv: list[str] | None = None) -> int:
    """`mhar export-hf SRC OUT`: a checkpoint of any strategy to a Hugging Face directory."""
    parser = argparse.ArgumentParser(
        prog="mhar export-hf",
        description="Export a checkpoint (.ckpt, consolidated, or converted directory) to a Hugging Face directory: "
        "`sum` models as LlamaForCausalLM, routed ones with their own modeling code (trust_remote_code=True).",
    )
    parser.add_argument("src", help=".ckpt file, consolidated checkpoint or converted directory (mhar_config.json)")
    parser.add_argument("out", help="new (or empty) output directory")
    parser.add_argument("--tokenizer", help="tokenizer to ship (default: the one a .ckpt was trained with)")
    add_output_options(parser)
    add_residual_option(parser)
    args = parser.parse_args(argv)
    dtype = DTYPES.get(args.dtype)

    def export() -> None:
        from mhar_lightning.eval.loading import load_model  # here: the eval package imports lm-eval, where installed

        if Path(args.src).is_dir() and (Path(args.src) / CONFIG_FILE).is_file():
            tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
            export_hf(args.src, args.out, dtype=dtype, max_shard_size=args.max_shard_size, tokenizer=tokenizer)
            return
        loaded = load_model(args.src, args.tokenizer, device="cpu", dtype=args.dtype or stored_dtype(args.src))
        export_training_checkpoint(
            loaded.model,
            loaded.init_from,
            args.out,
            tokenizer=loaded.tokenizer,
            dtype=dtype,
            max_shard_size=args.max_shard_size,
        )

    return run(parser.prog, export)
