"""The current folder's modules, importable for the class paths the user names (as `python -m` makes them), and no
others: a module there is found only after everything installed, and only when a flag, a recipe or `--residual`
names a class in it, so a class path read from a checkpoint, or a library's optional import, never finds one."""

import importlib.abc
import importlib.machinery
import os
import sys

USER_MODULES: set[str] = set()
"""Top-level modules of the class paths the user named, which may be found in the current folder."""


class UserFolderFinder(importlib.abc.MetaPathFinder):
    """Finds a top-level module in the current folder when the user named a class in it (after every other finder)."""

    def find_spec(self, name, path=None, target=None):
        if path is not None or name not in USER_MODULES:
            return None  # a submodule is found through its package's own path
        return importlib.machinery.PathFinder.find_spec(name, [os.getcwd()])


def allow_user_module(class_path: str) -> None:
    """Let the top-level module of `class_path`, a class the user named, be imported from the current folder."""
    USER_MODULES.add(class_path.partition(".")[0])
    if not any(isinstance(finder, UserFolderFinder) for finder in sys.meta_path):
        sys.meta_path.append(UserFolderFinder())
