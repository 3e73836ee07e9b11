"""What a checkpoint's content digest and finiteness check cost, against writing and reading the checkpoint.

A 100m model's checkpoint as `mhar fit` writes it (fp32 weights and AdamW's two moments), on CPU: the time to
write it (`AtomicCheckpointIO`, digest included), to compute the digest alone, and to read it back: the file's
bytes (the floor of any check), its digest, the finiteness of its weights (every command) and of its optimizer state
(`fit` when resuming), and the digest and weights together as every command reads it (`read_checkpoint`).

    python benchmarks/checkpoint_digest.py [--preset 100m] [--dir /tmp]
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch

from mhar_lightning.checkpoint.atomic_write import AtomicCheckpointIO
from mhar_lightning.checkpoint.digest import content_digest, verify_digest
from mhar_lightning.checkpoint.finite import check_finite_optimizer, check_finite_state
from mhar_lightning.checkpoint.read_file import read_checkpoint
from mhar_lightning.config import ModelConfig
from mhar_lightning.model import Decoder
from mhar_lightning.residual import make_residual


def timed(name: str, fn, size: float) -> None:
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    print(f"{name:34s} {seconds:6.2f} s  ({size / seconds:6.0f} MB/s)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="100m")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where to write the checkpoint")
    args = parser.parse_args()
    decoder = Decoder(ModelConfig.preset(args.preset), make_residual("mhar"))
    weights = {f"decoder.{k}": v for k, v in decoder.state_dict().items()}
    moments = {i: {"step": torch.tensor(10.0), "exp_avg": p.clone(), "exp_avg_sq": p.square()}
               for i, p in enumerate(decoder.parameters())}  # fmt: skip
    checkpoint = {"global_step": 10, "state_dict": weights, "optimizer_states": [{"state": moments}]}
    size = sum(t.numel() * t.element_size() for t in [*weights.values(), *(m[k] for m in moments.values()
               for k in ("exp_avg", "exp_avg_sq"))]) / 1e6  # fmt: skip
    params = sum(p.numel() for p in decoder.parameters()) / 1e6
    print(f"{args.preset}: {params:.0f}M parameters, checkpoint {size:.0f} MB, {torch.get_num_threads()} threads")
    path = args.dir / "digest-benchmark.ckpt"
    try:
        timed("digest alone", lambda: content_digest(checkpoint), size)
        timed("write (digest included)", lambda: AtomicCheckpointIO().save_checkpoint(checkpoint, path), size)
        timed("read the file's bytes (the floor)", path.read_bytes, size)
        loaded = read_checkpoint(path, verify=False)  # memory-mapped: nothing is read yet
        timed("verify its digest", lambda: verify_digest(loaded, path), size)
        timed("check its weights are finite", lambda: check_finite_state(loaded["state_dict"], str(path)), size)
        timed("check its optimizer state is finite", lambda: check_finite_optimizer(loaded, str(path)), size)
        timed("read and verify (every command)", lambda: read_checkpoint(path), size)
    finally:
        path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
