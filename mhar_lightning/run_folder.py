"""One run per folder: a live `mhar fit` holds a lock on the folder its checkpoints go to, and that folder holds one
`last.ckpt`, so two runs never interleave their checkpoints and `--ckpt_path last` names one file."""

import json
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from mhar_lightning.errors import CheckpointError, ConfigError
from mhar_lightning.processes import process_alive

LOCK_FILE = ".mhar-run.lock"
LAST_PATTERN = "last*.ckpt"


@dataclass(frozen=True)
class Holder:
    """The process that holds a folder's lock."""

    pid: int
    host: str
    started: str

    def __str__(self) -> str:
        return f"pid {self.pid} on {self.host}, started {self.started}"

    def alive(self) -> bool:
        """Whether the holder may still run: always, unless it is a process of this host that has ended."""
        return process_alive(self.pid, self.host)


class RunLock:
    """The lock file of a run's checkpoint folder, created atomically with its holder inside; `release` deletes it."""

    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder) / LOCK_FILE
        self.holder = Holder(os.getpid(), socket.gethostname(), time.strftime("%Y-%m-%d %H:%M:%S %Z"))

    def acquire(self) -> None:
        """Take the lock; refuse (`ConfigError`) while a live run holds it, take it over from a dead one (saying so)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while not self._create():
            holder = self.read_holder()
            if holder is None and not self.path.exists():
                continue  # released meanwhile
            if holder is not None and holder.alive():
                raise ConfigError(
                    f"checkpoint folder {self.path.parent} is in use by another mhar fit ({holder}): wait for it to"
                    " end or choose another --trainer.default_root_dir; if that run is gone, delete"
                    f" {self.path}"
                )
            self.path.unlink(missing_ok=True)
            gone = f"from {holder}, which has ended" if holder is not None else "that named no holder"
            print(f"mhar: took over the lock of {self.path.parent} {gone}", file=sys.stderr)

    def _create(self) -> bool:
        """Write the lock with its holder in one step (a hard link of a complete file); False if it exists."""
        tmp = self.path.with_name(f"{LOCK_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(self.holder)) + "\n")
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink()

    def read_holder(self) -> Holder | None:
        """The holder the lock file names, or None when it is gone or unreadable."""
        try:
            return Holder(**json.loads(self.path.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def release(self) -> None:
        """Delete the lock if this process holds it."""
        if self.read_holder() == self.holder:
            self.path.unlink(missing_ok=True)


def last_checkpoint(folder: str | Path) -> str | None:
    """The folder's `last.ckpt` (None if none); several `last*.ckpt` are refused, naming them, as ambiguous."""
    found = sorted(Path(folder).glob(LAST_PATTERN))
    if len(found) > 1:
        names = ", ".join(path.name for path in found)
        raise CheckpointError(
            f"--ckpt_path last is ambiguous: {folder} holds {names}; keep the one to resume (renamed last.ckpt) and"
            " move the others away, or pass the file with --ckpt_path"
        )
    return str(found[0]) if found else None


def check_fresh_run(folder: str | Path, ckpt_path: str | None) -> None:
    """Refuse a run that would write into a folder holding another run's checkpoints: only a run resumed from a
    checkpoint of this folder continues there (and overwrites its `last.ckpt`)."""
    folder = Path(folder)
    if ckpt_path is not None and Path(ckpt_path).resolve().parent == folder.resolve():
        return
    earlier = sorted(path.name for path in folder.glob("*.ckpt")) if folder.is_dir() else []
    if earlier:
        shown = ", ".join(earlier[:3]) + (", ..." if len(earlier) > 3 else "")
        raise ConfigError(
            f"checkpoint folder {folder} holds checkpoints of an earlier run ({shown}): resume it with --ckpt_path"
            " last, or start a new run in another --trainer.default_root_dir"
        )
