"""Exact resume through `mhar fit --ckpt_path last`: a stopped and resumed run equals an uninterrupted one.

Each case trains N steps in one go, then separately trains the same config, stops it after k < N steps,
resumes it from the checkpoint and continues to N. The per-step training losses after k (read back from
TensorBoard) and the final weights must be identical, on one process and on two DDP processes (gloo, CPU).
"""

from pathlib import Path

import pytest
import torch
from cli_helpers import DDP_STEPS, NO_PROBES, fast_demo_args, final_weights, run_ddp, scalars

from mhar_lightning.cli import main
from mhar_lightning.optim import OptimizerConfig, lr_factor

N, K = DDP_STEPS, 4
MUON = ["--model.optimizer.name", "muon", "--model.optimizer.muon_lr", "0.01"]
STOP = ["--trainer.callbacks+=cli_helpers.StopAtStep", f"--trainer.callbacks.step={K}"]
pytestmark = pytest.mark.usefixtures("default_corpus")


@pytest.mark.parametrize(
    "launch, extra", [(main, []), (run_ddp, []), (main, MUON)], ids=["single", "ddp-2", "single-muon"]
)
def test_stop_and_resume_equals_uninterrupted(
    tmp_path: Path, launch, extra: list[str], request: pytest.FixtureRequest
) -> None:
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    if launch is run_ddp:
        full = request.getfixturevalue("ddp_demo_run")  # the uninterrupted DDP run, which the probe test reads too
    else:
        launch(fast_demo_args(full, N) + NO_PROBES + extra)  # no test reads this run's depth maps: none are drawn
    launch(fast_demo_args(resumed, N) + NO_PROBES + extra + STOP)
    checkpoint = torch.load(resumed / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["global_step"] == K
    if extra == MUON:  # Muon's momentum for the hidden matrices, Adam's moments for the rest
        saved = checkpoint["optimizer_states"][0]
        assert [sorted(state) for state in saved["state"].values()].count(["momentum_buffer"]) == 4 * 7
        assert saved["param_groups"][0]["lr"] == pytest.approx(0.01 * lr_factor(K, N, OptimizerConfig(warmup_steps=2)))
    launch(fast_demo_args(resumed, N) + NO_PROBES + extra + ["--ckpt_path", "last"])

    reference = scalars(full, "train/loss")
    after_resume = scalars(resumed, "train/loss", version=-1)
    assert sorted(reference) == list(range(N))
    assert sorted(after_resume) == list(range(K, N)), "the resumed run must start at step k"
    assert after_resume == {step: reference[step] for step in range(K, N)}

    want, got = final_weights(full), final_weights(resumed)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_a_run_preempted_by_sigterm_saves_its_step_and_resumes_exactly(tmp_path: Path) -> None:
    """SIGTERM after step k with no periodic save due: the run saves step k, exits 143, and resuming it gives the
    uninterrupted run's losses and weights."""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    rare_saves = ["--checkpoint.every_n_train_steps", "100"]
    main(fast_demo_args(full, N) + NO_PROBES + rare_saves)
    sigterm = ["--trainer.callbacks+=cli_helpers.SigtermAtStep", f"--trainer.callbacks.step={K + 1}"]
    with pytest.raises(SystemExit) as stopped:
        main(fast_demo_args(resumed, N) + NO_PROBES + rare_saves + sigterm)
    assert stopped.value.code == 143
    saved = torch.load(resumed / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"]
    assert saved == K + 1
    main(fast_demo_args(resumed, N) + NO_PROBES + rare_saves + ["--ckpt_path", "last"])
    reference, after_resume = scalars(full, "train/loss"), scalars(resumed, "train/loss", version=-1)
    assert after_resume == {step: reference[step] for step in range(K + 1, N)}
    want, got = final_weights(full), final_weights(resumed)
    assert all(torch.equal(got[name], want[name]) for name in want)


def test_a_run_killed_during_a_validation_runs_that_validation_when_resumed(tmp_path: Path) -> None:
    """Killed inside the validation after step 4 (the second), the run resumes from its step-4 checkpoint: it runs
    that validation first, with the uninterrupted run's loss, instead of skipping it, then trains on exactly."""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    every_2 = ["--trainer.val_check_interval", "2"]
    main(fast_demo_args(full, 5) + NO_PROBES + every_2)
    crash = ["--trainer.callbacks+=cli_helpers.CrashInValidation", "--trainer.callbacks.step=4"]
    with pytest.raises(RuntimeError, match="killed in the validation after step 4"):
        main(fast_demo_args(resumed, 5) + NO_PROBES + every_2 + crash)
    reference = scalars(full, "val/loss")  # logged at the index of the step it follows
    assert sorted(reference) == [1, 3] and sorted(scalars(resumed, "val/loss")) == [1]
    main(fast_demo_args(resumed, 5) + NO_PROBES + every_2 + ["--ckpt_path", "last"])
    assert scalars(resumed, "val/loss", version=-1) == {3: reference[3]}
    assert scalars(resumed, "train/loss", version=-1) == {4: scalars(full, "train/loss")[4]}
    assert torch.equal(final_weights(resumed)["decoder.embed.weight"], final_weights(full)["decoder.embed.weight"])
