"""Residual classes a file may name. A `class_path` read from a checkpoint or a converted directory is imported only
when it names a registered strategy (the kit's, one registered with `@register_residual`, or an installed package's
entry point) or a class the user named as well; anything else is refused before its module is imported, so a file
never chooses what code runs."""

import argparse
import contextlib
import sys
from collections.abc import Mapping
from typing import Any

from mhar_lightning.errors import CheckpointError
from mhar_lightning.residual.base import RESIDUALS
from mhar_lightning.user_modules import allow_user_module

NAMED_BY_USER: set[str] = set()
"""Class paths the user named in this process (a flag or a recipe), which files may name too."""


def allow_class_path(class_path: str) -> None:
    """Let files name `class_path` in this process, and its module be found in the current folder: the user named
    it."""
    NAMED_BY_USER.add(class_path)
    allow_user_module(class_path)


def imported(class_path: str) -> object | None:
    """The object `class_path` names if its module is imported already, else None (nothing is imported, and no
    module `__getattr__` runs)."""
    module, _, name = class_path.rpartition(".")
    return vars(sys.modules[module]).get(name) if module in sys.modules else None


def registered(class_path: str) -> bool:
    """Whether `class_path` names a registered strategy class or, under another path, one the user named. Only entry
    points of the installed package that `class_path` starts with are loaded; no other module is imported."""
    top = class_path.partition(".")[0]
    for name, entry_point in RESIDUALS.entry_points().items():
        if entry_point.module.partition(".")[0] == top:
            with contextlib.suppress(ValueError):  # a broken entry point registers nothing
                RESIDUALS[name]  # imports the installed package that declares it
    known = [*RESIDUALS.classes.values(), *filter(None, map(imported, NAMED_BY_USER))]
    found = imported(class_path)
    return found is not None and any(found is cls for cls in known)


def check_stored_residual(spec: Any, source: str) -> None:
    """Refuse the residual `spec` that file `source` records (a `{class_path, init_args}` mapping or a strategy name)
    when it names a class that is neither registered nor named by the user, without importing it."""
    if not isinstance(spec, Mapping) or "class_path" not in spec:
        return  # a strategy name is looked up in the registry; anything else is refused by `make_residual`
    class_path = spec.get("class_path")
    if isinstance(class_path, str) and (class_path in NAMED_BY_USER or registered(class_path)):
        return
    raise CheckpointError(
        f"{source} names residual class {class_path!r}, which is neither a built-in nor an installed strategy, so it"
        " was not imported: if you trust it, name it yourself (--model.residual.class_path CLASS for fit and validate,"
        " --residual CLASS for the tools) or install it as a package with a mhar_lightning.residuals entry point"
    )


class AllowClassPath(argparse.Action):
    """`--residual CLASS_PATH` of the tools that load checkpoints: the user names a class that files may name."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        allow_class_path(values)
        setattr(namespace, self.dest, values)


def add_residual_option(parser: argparse.ArgumentParser) -> None:
    """Add `--residual CLASS_PATH` to a tool that loads checkpoints."""
    parser.add_argument(
        "--residual",
        metavar="CLASS_PATH",
        action=AllowClassPath,
        help="the residual class a checkpoint of your own strategy names (imported only when given here, unless the"
        " strategy is built in or installed with a mhar_lightning.residuals entry point)",
    )
