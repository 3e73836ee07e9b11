"""A 2-process FSDP2 run killed after its sharded checkpoint resumes with exactly the losses of an uninterrupted run.

The run is killed after the loss of its last step, before that step's save: up to there it is itself the
uninterrupted run, so the resumed run must repeat its losses after the checkpoint bit for bit (one launch fewer).
"""

import json
from pathlib import Path

import pytest
from fsdp_helpers import DELTA, converted_init, run_ranks, tiny_corpus

STEPS, CKPT_EVERY = 8, 5
KILL_AT = STEPS  # after the loss of step 8 is recorded; the last save was at step 5
LAST_SAVE = KILL_AT // CKPT_EVERY * CKPT_EVERY


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_killed_run_resumes_exactly(tmp_path: Path, optimizer: str) -> None:
    """With either optimizer: Muon steps FSDP2's DTensor shards with torch's own `torch.optim.Muon`."""
    _, init = converted_init(tmp_path, DELTA, tie=False)
    model = ["--data", str(tiny_corpus(tmp_path)), "--init", str(init), "--residual", json.dumps(DELTA), "--untied"]
    model += ["--optimizer", optimizer]

    def args(out: Path, devices: int = 2, *extra: str) -> list[str]:
        return ["--out", str(out), *model, "--fsdp", "--devices", str(devices), "--steps", str(STEPS), *extra]

    def records(rank: int) -> list[dict]:
        return [json.loads(line) for line in (run / f"losses-rank{rank}.jsonl").read_text().splitlines()]

    run = tmp_path / "run"
    killed = run_ranks(*args(run, 2, "--ckpt-every", str(CKPT_EVERY), "--kill-at", str(KILL_AT)))
    assert killed.returncode == 17, killed.stdout[-3000:]  # every rank died right after step KILL_AT
    assert (run / "ckpt" / "last.ckpt").resolve().name == f"epoch=0-step={LAST_SAVE}.ckpt"
    assert [len(records(r)) for r in (0, 1)] == [KILL_AT, KILL_AT]
    uninterrupted = {rank: {r["step"]: r["loss"] for r in records(rank)} for rank in (0, 1)}

    resumed = run_ranks(*args(run, 2, "--ckpt-every", str(CKPT_EVERY), "--resume", "last"))
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert (run / "ckpt" / "last.ckpt").resolve().name == f"epoch=0-step={STEPS}.ckpt"  # the final step, not step 5
    assert not list((run / "ckpt").glob("last-v*"))
    for rank in (0, 1):
        after = {r["step"]: r["loss"] for r in records(rank)[KILL_AT:]}
        assert sorted(after) == list(range(LAST_SAVE + 1, STEPS + 1))  # continued from the checkpoint's step
        reference = uninterrupted[rank]
        assert after == {step: reference[step] for step in after}  # bit-exact: weights, optimizer, schedule, data

    other = run_ranks(
        *args(tmp_path / "other", 1, "--ckpt-every", str(CKPT_EVERY), "--resume", str(run / "ckpt" / "last.ckpt"))
    )
    assert other.returncode != 0
    assert "written by 2 ranks and this run has 1: resume its training with 2 ranks" in other.stdout
