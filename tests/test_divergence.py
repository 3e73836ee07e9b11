"""A non-finite loss or gradient norm stops training before the step is applied (or skips it, when asked), on one
process and on two ranks; no checkpoint with non-finite weights is written, and none is loaded."""

from pathlib import Path

import pytest
import torch
from cli_helpers import DEMO, NO_PROBES, fast_demo_args, scalars
from fsdp_helpers import run_ranks, tiny_corpus
from test_cli import run

from mhar_lightning.module import LanguageModel

pytestmark = pytest.mark.usefixtures("default_corpus")


def checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def all_finite(state: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in state.values() if t.is_floating_point())


def nan_loss_at(monkeypatch, step: int) -> None:
    """Make the training loss NaN at optimizer step `step` (1-based): a bad batch."""
    loss = LanguageModel.loss

    def loss_nan_at_step(self, batch, *args):
        value = loss(self, batch, *args)
        return value * float("nan") if self.training and self.trainer.global_step + 1 == step else value

    monkeypatch.setattr(LanguageModel, "loss", loss_nan_at_step)


def test_diverging_run_stops_with_one_line_and_keeps_the_last_finite_checkpoint(tmp_path: Path, capsys) -> None:
    args = [*fast_demo_args(tmp_path, max_steps=6), "--model.optimizer.lr", "1e3"]
    code, _, err = run(args, capsys)
    assert code == 3
    last = err.strip().splitlines()[-1]
    assert last.startswith("mhar: error: training diverged at step ") and "the gradient norm is inf" in last, last
    assert "Traceback" not in err
    failed_step = int(last.removeprefix("mhar: error: training diverged at step ").split(":")[0])
    saved = checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    assert saved["global_step"] == failed_step - 1  # every step before it was saved, the failing one was not
    assert all_finite(saved["state_dict"])


def test_a_nan_loss_stops_the_run_naming_the_step(tmp_path: Path, capsys, monkeypatch) -> None:
    nan_loss_at(monkeypatch, 3)
    code, _, err = run(fast_demo_args(tmp_path, max_steps=5), capsys)
    assert code == 3
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith("mhar: error: training diverged at step 3: the loss is not finite and the gradient norm is nan;")
    )
    assert checkpoint(tmp_path / "checkpoints" / "last.ckpt")["global_step"] == 2


def test_skip_nonfinite_drops_the_bad_step_and_logs_it(tmp_path: Path, capsys, monkeypatch) -> None:
    nan_loss_at(monkeypatch, 3)
    args = [*fast_demo_args(tmp_path, max_steps=4), "--model.skip_nonfinite", "1", "--checkpoint.save_top_k", "-1"]
    args += NO_PROBES
    message = r"step 3: the loss is not finite and the gradient norm is nan; skipped it \(1 of 1 in a row\)"
    with pytest.warns(UserWarning, match=message):
        code, _, err = run(args, capsys)
    assert code == 0, err
    assert scalars(tmp_path, "train/skipped_steps") == {0: 0.0, 1: 0.0, 2: 1.0, 3: 1.0}
    ckpts = tmp_path / "checkpoints"
    before, skipped, after = (checkpoint(ckpts / f"epoch=0-step={s}.ckpt")["state_dict"] for s in (2, 3, 4))
    assert all(torch.equal(before[k], skipped[k]) for k in before)  # the skipped step changed no weight
    assert not all(torch.equal(skipped[k], after[k]) for k in skipped)  # and training went on


def test_weights_that_became_non_finite_are_not_saved(tmp_path: Path, capsys, monkeypatch) -> None:
    step = LanguageModel.optimizer_step

    def step_then_corrupt(self, *args, **kwargs):
        step(self, *args, **kwargs)
        if self.trainer.global_step + 1 == 3:  # global_step counts the steps done before this one
            with torch.no_grad():
                next(self.parameters()).fill_(float("nan"))

    monkeypatch.setattr(LanguageModel, "optimizer_step", step_then_corrupt)
    code, _, err = run(fast_demo_args(tmp_path, max_steps=5), capsys)
    assert code == 3
    assert "training diverged: the weights after step 3 are not finite" in err.strip().splitlines()[-1]
    saved = checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    assert saved["global_step"] == 2 and all_finite(saved["state_dict"])


def test_a_non_finite_checkpoint_is_refused(tmp_path: Path, capsys, demo_run: Path) -> None:
    saved = checkpoint(demo_run / "checkpoints" / "last.ckpt")
    name = next(iter(saved["state_dict"]))
    saved["state_dict"][name] = torch.full_like(saved["state_dict"][name], float("nan"))
    del saved["content_digest"]  # an edit keeping it is refused as damage (tests/checkpoint/test_integrity.py)
    torch.save(saved, tmp_path / "nan.ckpt")
    args = ["validate", "--config", str(DEMO), "--trainer.default_root_dir", str(tmp_path)]
    code, _, err = run([*args, "--ckpt_path", str(tmp_path / "nan.ckpt")], capsys)
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        f"mhar: error: checkpoint {tmp_path / 'nan.ckpt'} has non-finite weights (1 of {len(saved['state_dict'])}"
        f" tensors, first {name}): training had diverged when it was saved; use an earlier checkpoint"
    )


@pytest.mark.parametrize("strategy", [[], ["--fsdp"]], ids=["ddp", "fsdp"])
def test_a_non_finite_loss_on_one_rank_stops_every_rank(tmp_path: Path, strategy: list[str]) -> None:
    out = tmp_path / "run"
    args = ["--out", str(out), "--data", str(tiny_corpus(tmp_path)), "--steps", "5", "--ckpt-every", "1"]
    done = run_ranks(*args, *strategy, "--inf-loss-at", "3")
    assert done.returncode != 0
    output = done.stdout + done.stderr
    line = "TrainingDiverged: training diverged at step 3: the loss is not finite;"
    assert output.count(line) == 2, output[-3000:]  # rank 0's loss was finite: it stopped on the reduced decision
    for rank in (0, 1):
        assert len((out / f"losses-rank{rank}.jsonl").read_text().splitlines()) == 2
    assert (out / "ckpt" / "last.ckpt").resolve().name == "epoch=0-step=2.ckpt"
