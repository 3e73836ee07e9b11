"""`StepProgressBar` through `mhar fit`: host reads of tensors only at log steps (so a GPU run never waits for the
device between steps), the loss on the bar, and a plain line per interval off a terminal with no third-party noise."""

import collections
import json
import re
import subprocess
import sys
import traceback
from pathlib import Path

import lightning as L
import pytest
import torch
from cli_helpers import DEMO, env_with_tests_on_path, fast_demo_args

from mhar_lightning.trainer_cli import MharCLI

pytestmark = pytest.mark.usefixtures("default_corpus")
READS = ("item", "__float__", "__int__", "__bool__", "tolist", "numpy")
"""Tensor methods that copy a value to the host (on a GPU: wait for every kernel queued before it)."""


def in_cpu_optimizer() -> bool:
    """Whether the caller is AdamW's per-tensor CPU loop, which reads its step count, or the divergence guard's CPU
    path, which reads its flags at once. On CUDA the recipes' fused AdamW reads nothing, and skips a bad step on the
    device, so the guard reads its flags a step later from a pinned copy (`test_module_gpu.py`)."""
    return any(
        "torch/optim/" in frame.filename or frame.filename.endswith("mhar_lightning/divergence.py")
        for frame in traceback.extract_stack(limit=8)
    )


class Recording(L.Callback):
    """Counts host reads of tensors per optimizer step, from the step's start to the next step's start."""

    def __init__(self, reads: collections.Counter) -> None:
        self.reads = reads
        self.step: int | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.step = trainer.global_step + 1


def test_host_reads_only_at_log_steps(tmp_path, monkeypatch) -> None:
    """The demo recipe's callbacks (throughput, memory, learning rate, depth probes), the progress bar and the
    logger read training tensors on the host only at steps that log (every `log_every_n_steps`)."""
    reads: collections.Counter = collections.Counter()
    recording = Recording(reads)
    for name in READS:
        method = getattr(torch.Tensor, name)

        def counted(self, *args, _method=method, **kwargs):
            if recording.step is not None and not in_cpu_optimizer():
                reads[recording.step] += 1
            return _method(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    args = ["--config", str(DEMO), "--trainer.default_root_dir", str(tmp_path), "--trainer.max_steps", "12"]
    args += ["--trainer.log_every_n_steps", "4", "--trainer.limit_val_batches", "0", "--checkpoint.save_last", "false"]
    args += ["--data.seq_len", "32", "--data.batch_size", "2"]
    cli = MharCLI(args=args, run=False)
    cli.trainer.callbacks.append(recording)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert any(reads[step] for step in (4, 8)), "the logger reads the logged metrics at log steps"
    between = {step: reads[step] for step in range(2, 12) if step % 4 and reads[step]}
    assert not between, f"host reads at steps that do not log: {between}"


@pytest.mark.parametrize("log_every", [1, 3])
def test_bar_shows_the_training_loss(tmp_path, log_every) -> None:
    """The loss is logged without `prog_bar` (which would read it every step); the bar still shows it."""
    args = ["--config", str(DEMO), "--trainer.default_root_dir", str(tmp_path), "--trainer.max_steps", "3"]
    args += ["--trainer.log_every_n_steps", str(log_every), "--trainer.limit_val_batches", "0"]
    args += ["--checkpoint.save_last", "false", "--data.seq_len", "32", "--data.batch_size", "2"]
    cli = MharCLI(args=args, run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    bar = cli.trainer.progress_bar_callback
    shown = bar.get_metrics(cli.trainer, cli.model)
    assert float(shown["train/loss"]) == pytest.approx(float(cli.trainer.callback_metrics["train/loss"]), rel=1e-3)
    assert "train/loss" not in cli.trainer.progress_bar_metrics


def test_fit_off_a_terminal_prints_plain_progress_lines_and_no_noise(tmp_path: Path) -> None:
    """Fixed decimals, tokens/s and MFU (windows of one step, a CPU peak given) beside the loss, then one closing line
    instead of Lightning's `Trainer.fit` message and the bar's last state."""
    args = [*fast_demo_args(tmp_path, max_steps=4), "--trainer.enable_progress_bar", "true"]
    monitor = {"class_path": "mhar_lightning.callbacks.TokenThroughputMonitor"}
    monitor["init_args"] = {"window_size": 1, "peak_flops": 1e9}
    done = subprocess.run(
        [sys.executable, "-m", "mhar_lightning.cli", *args, "--trainer.log_every_n_steps", "2",
         "--trainer.callbacks", json.dumps([monitor])],
        env=env_with_tests_on_path(), capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in lines] == ["step 2/4 (50%)", "step 4/4 (100%)"]
    assert re.fullmatch(r"step 2/4 \(50%\) \| train/loss \d\.\d{3} \| \d+\.\d\d steps/s \| eta \dm\d\ds", lines[0])
    assert re.fullmatch(
        r"step 4/4 \(100%\) \| val/loss \d\.\d{3} \| train/loss \d\.\d{3} \| tok/s [\d,]+ \| MFU \d+\.\d% \| "
        r"\d+\.\d\d steps/s \| eta 0m00s",
        lines[1],
    ), lines[1]
    last = done.stdout.strip().splitlines()[-1]
    checkpoint = tmp_path / "checkpoints" / "last.ckpt"
    assert re.fullmatch(
        rf"done: step 4/4 in \d+s \| val/loss \d\.\d{{3}} at step 3 \| checkpoint {checkpoint}", last
    ), last
    for noise in ("Tip:", "litlogger", "set_vital", "LeafSpec", "FLOPs", "Epoch 0", "Trainer.fit"):
        assert noise not in done.stdout + done.stderr, noise


def test_bar_counts_optimizer_steps_across_a_resume(tmp_path, monkeypatch) -> None:
    """A run bounded by `max_steps` on a terminal: the bar reads steps done out of `max_steps`, before and after a
    resume, and its speed counts only the steps this run trained (rich's samples: the progress made since the task
    started)."""
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    args = ["--config", str(DEMO), "--trainer.default_root_dir", str(tmp_path), "--trainer.limit_val_batches", "0"]
    args += ["--data.seq_len", "32", "--data.batch_size", "2", "--checkpoint.every_n_train_steps", "4"]
    for max_steps, ckpt_path in ((4, None), (6, "last")):
        cli = MharCLI(args=[*args, "--trainer.max_steps", str(max_steps)], run=False)
        cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path)
        bar = cli.trainer.progress_bar_callback
        task = bar.progress.tasks[bar.train_progress_bar_id]
        assert (task.completed, task.total) == (max_steps, max_steps)
        assert sum(sample.completed for sample in task._progress) == (4 if ckpt_path is None else 2)
