"""Shared pieces of the multi-process FSDP2 tests: a tiny prepared corpus, initial weights, and running ranks."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from mhar_lightning.config import ModelConfig
from mhar_lightning.data.prepare import prepare_files
from mhar_lightning.data.tokenizer import load_tokenizer
from mhar_lightning.model import Decoder
from mhar_lightning.residual import HyperConnections, make_residual

SCRIPT = Path(__file__).with_name("fsdp_run.py")
MHAR = {"class_path": "mhar_lightning.residual.MHAR", "init_args": {"heads": 4, "blocks": 4}}
DELTA = {"class_path": "mhar_lightning.residual.DeltaMHAR", "init_args": {"heads": 4, "block_size": 2}}
HC = {"class_path": "mhar_lightning.residual.HyperConnections", "init_args": {"rate": 3, "dynamic": True}}


def tiny_corpus(root: Path) -> Path:
    """A few standard-library sources as byte tokens (about 100k tokens)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [stdlib / name for name in ("abc.py", "bisect.py", "calendar.py", "colorsys.py", "copy.py")]
    out = root / "corpus"
    prepare_files(files, out, load_tokenizer("byte"), val_fraction=0.0, progress=False)
    return out


def converted_init(root: Path, residual: dict, tie: bool = True, seed: int = 1) -> tuple[Decoder, Path]:
    """The model and a converted-checkpoint directory (the `mhar convert` layout) with random tiny-model weights.

    The routing queries are randomised too, so that routing actually mixes depth from the first step.
    """
    config = ModelConfig.preset("tiny", max_seq_len=32, tie_embeddings=tie)
    template = make_residual(residual)
    std = 0.05 if isinstance(template, HyperConnections) else 0.5  # larger stream mixes compound rounding over depth
    out = root / f"init-{type(template).__name__}-{'tied' if tie else 'untied'}"
    torch.manual_seed(seed)
    model = Decoder(config, template)
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if ".residual." in param_name or param_name.startswith("final_residual."):
                p.normal_(std=std)
    out.mkdir(exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tie and k == "head.weight")}
    save_file(state, str(out / "model.safetensors"))
    meta = {"format_version": 1, "model": config.to_dict(), "residual": template.spec()}
    (out / "mhar_config.json").write_text(json.dumps(meta))
    return model, out


def run_ranks(*args: str, timeout: float = 120, log: Path | None = None) -> subprocess.CompletedProcess:
    """Run `fsdp_run.py` on `--devices` ranks (default 2), started together as torchrun starts them (Lightning sees
    `LOCAL_RANK` and launches none itself), so they import at the same time. Returns rank 0's exit code unless it is
    0 and another rank's is not; past `timeout`, every rank is killed and `subprocess.TimeoutExpired` raised. Both
    streams of every rank go to `log` (default: a temporary file) as they are written, so a run killed from outside
    still leaves its output; the returned process holds it as stdout."""
    ranks = 2
    for flag, value in zip(args, args[1:]):
        ranks = int(value) if flag == "--devices" else ranks
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    env |= {"MASTER_PORT": str(port), "NODE_RANK": "0", "WORLD_SIZE": str(ranks)}
    command = [sys.executable, str(SCRIPT), *args]
    deadline = time.monotonic() + timeout
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(log.open("w+") if log else tempfile.TemporaryFile("w+"))
        procs = [
            stack.enter_context(
                subprocess.Popen(command, env=env | {"LOCAL_RANK": str(rank)}, stdout=out, stderr=subprocess.STDOUT,
                                 text=True, start_new_session=True)
            )
            for rank in range(ranks)
        ]  # fmt: skip
        try:
            for proc in procs:
                proc.wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            raise
        out.seek(0)
        output = out.read()
    code = next((proc.returncode for proc in procs if proc.returncode), 0)
    return subprocess.CompletedProcess(command, code, output, "")


def losses(out: Path, rank: int) -> dict[int, float]:
    """Step -> loss of `rank` (the last record of a step wins, as after a resume)."""
    records = [json.loads(line) for line in (out / f"losses-rank{rank}.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}
