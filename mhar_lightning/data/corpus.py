"""The default corpus: the running interpreter's standard-library sources, present on every machine.

It is the ``.py`` files of ``sysconfig.get_paths()["stdlib"]`` without tests, third-party ``site-packages`` and a
few GUI/demo packages (about 10 MB for CPython 3.11), read in sorted order, so a given Python version and
tokenizer always give the same shards. It is prepared on first use into
``$MHAR_CACHE_DIR`` (default ``~/.cache/mhar-lightning``) under a name that includes the tokenizer and the exact
Python version; concurrent first uses (several ranks) are safe because preparation renames a finished folder
into place and the losers reuse the winner's.
"""

from __future__ import annotations

import os
import platform
import sysconfig
from pathlib import Path

from mhar_lightning.data.prepare import prepare_files
from mhar_lightning.data.shards import INDEX_FILE
from mhar_lightning.data.tokenizer import Tokenizer

_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip"}
)
VAL_FRACTION = 0.02


def cache_root() -> Path:
    """Where prepared default corpora are kept: ``$MHAR_CACHE_DIR`` or ``~/.cache/mhar-lightning``."""
    return Path(os.environ.get("MHAR_CACHE_DIR") or Path.home() / ".cache" / "mhar-lightning")


def stdlib_files() -> list[Path]:
    """The standard-library source files of the running interpreter that make up the corpus, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        path
        for path in root.rglob("*.py")
        if not any(part in _EXCLUDED_DIRS or part.startswith("test") for part in path.relative_to(root).parts)
    )


def corpus_dir(tokenizer: Tokenizer) -> Path:
    """The cache folder of the default corpus for ``tokenizer`` and this Python version."""
    return cache_root() / f"stdlib-py{platform.python_version()}-{tokenizer.name}-{tokenizer.fingerprint[:12]}"


def ensure_corpus(tokenizer: Tokenizer, progress: bool = True) -> Path:
    """The prepared default corpus for ``tokenizer``, preparing it first if it is not cached yet."""
    out = corpus_dir(tokenizer)
    if (out / INDEX_FILE).is_file():
        return out
    try:
        prepare_files(
            stdlib_files(),
            out,
            tokenizer,
            val_fraction=VAL_FRACTION,
            progress=progress,
            source=f"python {platform.python_version()} stdlib",
        )
    except FileExistsError:
        if not (out / INDEX_FILE).is_file():
            raise  # something else occupies the cache folder
    return out
