"""`mhar consolidate SHARDED_DIR OUT.ckpt`: a sharded (FSDP2) checkpoint as one file loadable on one device.

A sharded checkpoint written by Lightning's `ModelParallelStrategy` is a directory: the model and optimizer shards
(torch.distributed.checkpoint, one file per rank) plus `meta.pt` (loops, schedules, hyperparameters) from rank 0.
Consolidation reads only the model weights (not the optimizer state, which is twice their size), on one CPU
process, and writes a regular Lightning checkpoint that `LanguageModel.load_from_checkpoint` loads.
"""

import sys
import warnings
from pathlib import Path

import torch
from torch.distributed.checkpoint import TensorStorageMetadata, load

from mhar_lightning.arguments import ToolParser
from mhar_lightning.checkpoint.atomic_write import AtomicCheckpointIO
from mhar_lightning.checkpoint.finite import check_finite_state
from mhar_lightning.checkpoint.read_sharded import META_FILE, SafeFileSystemReader, check_sharded_checkpoint
from mhar_lightning.dtypes import DTYPES
from mhar_lightning.errors import CheckpointError

MODEL_KEY = "state_dict"


def consolidate(sharded_dir: str | Path, out: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write the full model weights (optionally cast to `dtype`) and the run's metadata of `sharded_dir` to `out`."""
    sharded_dir, out = Path(sharded_dir), Path(out)
    if not (sharded_dir / META_FILE).is_file() or not (sharded_dir / ".metadata").is_file():
        raise FileNotFoundError(
            f"{sharded_dir} is not a sharded checkpoint directory (no {META_FILE} and .metadata): pass a checkpoint"
            " written with ModelParallelStrategy(save_distributed_checkpoint=True)"
        )
    check_out(out)
    metadata = check_sharded_checkpoint(sharded_dir)
    checkpoint = torch.load(sharded_dir / META_FILE, map_location="cpu", weights_only=True)
    reader = SafeFileSystemReader(sharded_dir)
    prefix = f"{MODEL_KEY}."
    state = {
        key.removeprefix(prefix): torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process is the intent
        load({MODEL_KEY: state}, storage_reader=reader, no_dist=True)
    check_finite_state(state, str(sharded_dir))
    checkpoint[MODEL_KEY] = {k: v.to(dtype) if dtype and v.is_floating_point() else v for k, v in state.items()}
    try:
        AtomicCheckpointIO().save_checkpoint(checkpoint, out)  # a temporary file renamed into place: no partial OUT
    except CheckpointError as error:
        cause = str(error.__cause__ or error).splitlines()[0]
        raise OSError(f"writing {out} failed ({cause}): free space or choose another OUT; no file was left") from error
    return out


def check_out(out: Path) -> None:
    """Refuse an `out` that exists (a directory, or a file that may be a finished checkpoint) before the slow read."""
    if out.is_dir():
        raise FileExistsError(f"{out} is a directory: name the file to write, e.g. {out / 'model.ckpt'}")
    if out.exists():
        raise FileExistsError(f"{out} already exists: choose a new OUT or delete it first (it is never overwritten)")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OSError(f"cannot create the folder of {out} ({error.strerror}): choose another OUT") from error


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(prog="mhar consolidate", description=__doc__.splitlines()[0])
    parser.add_argument("sharded_dir", help="a sharded checkpoint directory (e.g. checkpoints/last.ckpt)")
    parser.add_argument("out", help="the single-file checkpoint to write (e.g. model.ckpt)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="cast the weights (default: as saved, fp32)")
    args = parser.parse_args(argv)
    try:
        out = consolidate(args.sharded_dir, args.out, DTYPES.get(args.dtype))
    except OSError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
