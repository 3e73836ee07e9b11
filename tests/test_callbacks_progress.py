"""What `mhar fit` prints: a plain progress line per logging interval off a terminal, and no third-party noise."""

import subprocess
import sys
from pathlib import Path

from cli_helpers import env_with_tests_on_path, fast_demo_args


def test_fit_off_a_terminal_prints_plain_progress_lines_and_no_noise(tmp_path: Path) -> None:
    args = [*fast_demo_args(tmp_path, max_steps=4), "--trainer.enable_progress_bar", "true"]
    done = subprocess.run(
        [sys.executable, "-m", "mhar_lightning.cli", *args, "--trainer.log_every_n_steps", "2"],
        env=env_with_tests_on_path(), capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in lines] == ["step 2/4 (50%)", "step 4/4 (100%)"]
    assert all("train/loss " in line and "steps/s" in line for line in lines)
    assert "Epoch 0/-2" not in done.stdout
    for noise in ("Tip:", "litlogger", "set_vital", "LeafSpec"):
        assert noise not in done.stdout + done.stderr, noise
