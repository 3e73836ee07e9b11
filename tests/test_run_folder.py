"""One run per folder: `mhar fit` locks its checkpoint folder (a live holder refuses a second run, a dead one's lock
is taken over, the lock goes when the run ends however it ends) and `--ckpt_path last` always names one file."""

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import DEMO, NO_PROBES, copy_run, fast_demo_args, mhar

from mhar_lightning.run_folder import LOCK_FILE, Holder, RunLock

pytestmark = pytest.mark.usefixtures("default_corpus")


def dead_pid() -> int:
    """The id of a process of this host that has ended."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def locked_by(folder: Path, holder: Holder) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LOCK_FILE).write_text(json.dumps(holder.__dict__))
    return folder / LOCK_FILE


def test_the_lock_of_a_dead_run_is_taken_over_and_released_at_the_end(tmp_path: Path, capsys) -> None:
    dead = Holder(dead_pid(), socket.gethostname(), "2026-01-01 00:00:00 UTC")
    lock = locked_by(tmp_path / "checkpoints", dead)
    code, err = mhar([*fast_demo_args(tmp_path, 1), *NO_PROBES], capsys)
    assert code == 0, err
    assert f"mhar: took over the lock of {tmp_path / 'checkpoints'} from {dead}, which has ended" in err
    assert not lock.exists()
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()


def test_a_lock_held_on_another_host_is_refused_naming_the_holder(tmp_path: Path, capsys) -> None:
    holder = Holder(1, "node-17", "2026-01-01 00:00:00 UTC")
    lock = locked_by(tmp_path / "checkpoints", holder)
    code, err = mhar(fast_demo_args(tmp_path, 1), capsys)
    assert code == 2
    assert err.strip() == (
        f"mhar: error: checkpoint folder {tmp_path / 'checkpoints'} is in use by another mhar fit (pid 1 on node-17,"
        " started 2026-01-01 00:00:00 UTC): wait for it to end or choose another --trainer.default_root_dir; if that"
        f" run is gone, delete {lock}"
    )
    assert json.loads(lock.read_text()) == holder.__dict__  # the holder's lock is left alone
    assert list((tmp_path / "checkpoints").iterdir()) == [lock]


def test_a_fresh_run_into_a_folder_of_checkpoints_is_refused_and_leaves_no_lock(
    tmp_path: Path, capsys, demo_run: Path
) -> None:
    copy_run(demo_run, tmp_path)
    last = tmp_path / "checkpoints" / "last.ckpt"
    before = last.read_bytes()
    code, err = mhar(fast_demo_args(tmp_path, 4), capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert f"checkpoint folder {tmp_path / 'checkpoints'} holds checkpoints of an earlier run (" in err
    assert "resume it with --ckpt_path last" in err
    assert last.read_bytes() == before
    assert not (tmp_path / "checkpoints" / LOCK_FILE).exists()  # released on the error


def test_a_resumed_run_overwrites_last_and_several_lasts_are_refused(tmp_path: Path, capsys, demo_run: Path) -> None:
    copy_run(demo_run, tmp_path)
    checkpoints = tmp_path / "checkpoints"
    code, err = mhar([*fast_demo_args(tmp_path, 3), *NO_PROBES, "--ckpt_path", "last"], capsys)
    assert code == 0, err
    assert sorted(p.name for p in checkpoints.glob("last*")) == ["last.ckpt"]
    assert torch.load(checkpoints / "last.ckpt", map_location="cpu", weights_only=True)["global_step"] == 3
    assert not (checkpoints / LOCK_FILE).exists()

    shutil.copyfile(checkpoints / "last.ckpt", checkpoints / "last-v1.ckpt")  # as earlier versions could leave
    validate = ["validate", "--config", DEMO, "--trainer.default_root_dir", tmp_path]
    for command in (fast_demo_args(tmp_path, 4), validate):
        code, err = mhar([*command, "--ckpt_path", "last"], capsys)
        assert code == 2
        assert err.strip() == (
            f"mhar: error: --ckpt_path last is ambiguous: {checkpoints} holds last-v1.ckpt, last.ckpt; keep the one"
            " to resume (renamed last.ckpt) and move the others away, or pass the file with --ckpt_path"
        )
    assert torch.load(checkpoints / "last.ckpt", map_location="cpu", weights_only=True)["global_step"] == 3


def test_release_leaves_a_lock_that_another_process_took(tmp_path: Path) -> None:
    mine = RunLock(tmp_path)
    mine.acquire()
    other = Holder(dead_pid(), socket.gethostname(), "now")
    locked_by(tmp_path, other)
    mine.release()
    assert RunLock(tmp_path).read_holder() == other
