"""Paths read from files: a name that a folder's own index gives must stay inside that folder, so a crafted index
cannot make the kit read anything else."""

import os
from pathlib import Path


def inside(folder: str | Path, name: object, follow_links: bool = True) -> Path | None:
    """`folder / name`, or None when `name` is not a relative path to something inside `folder`.

    With `follow_links` the path is resolved first, so a symbolic link that leads out of `folder` is refused too;
    without, only the name itself (`..`, an absolute path) is judged.
    """
    if not isinstance(name, str) or not name or os.path.isabs(name):
        return None
    if not follow_links:
        parts = Path(os.path.normpath(name)).parts
        return Path(folder) / name if parts and parts[0] not in (os.pardir, os.curdir) else None
    root = Path(folder).resolve()
    path = (root / name).resolve()
    return path if path != root and path.is_relative_to(root) else None
