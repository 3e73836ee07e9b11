"""Command-line errors in one line: `mhar <tool>: error: ...`, naming the closest option to an unknown one."""

import argparse
import difflib
import re
import sys
from collections.abc import Sequence
from typing import NoReturn

UNKNOWN_OPTION = re.compile(r"^unrecognized arguments: (\S+)|does not accept option '([^']+)'")


def closest_option(parser: argparse.ArgumentParser, message: str) -> str:
    """`; did you mean --key?` when `message` rejects an option (a flag or a config key) close to one of `parser`'s."""
    match = UNKNOWN_OPTION.search(message)
    if match is None:
        return ""
    given = "--" + (match.group(1) or match.group(2)).removeprefix("--").partition("=")[0]
    close = difflib.get_close_matches(given, parser._option_string_actions, 1)
    return f"; did you mean {close[0]}?" if close else ""


class ToolParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` for the kit's tools: an error is one line instead of the usage, and an unknown
    option (`--promt`) is named, with the closest known one, before any other complaint (a required `--prompt`).
    Options are never abbreviated, so a typo cannot pick another option."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Sequence[str] | None = None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        options = args[: args.index("--")] if "--" in args else args
        known = self._option_string_actions
        unknown = [arg for arg in options if arg.startswith("--") and arg.partition("=")[0] not in known]
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}")
        return super().parse_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}{closest_option(self, message)}\n")
