"""The `mhar` command: the Trainer subcommands (fit, validate, test) and the kit's tools (prepare, compare, ...).

Only the subcommand that runs is imported: a tool such as `mhar prepare` starts without loading Lightning.
"""

import os
import sys
from collections.abc import Sequence

from mhar_lightning.errors import MharError
from mhar_lightning.terminal import quiet_third_party_noise
from mhar_lightning.tools import TOOLS, run_tool


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the `mhar` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    quiet_third_party_noise()
    try:
        if args and args[0] in TOOLS:
            raise SystemExit(run_tool(args[0], args[1:]))
        from mhar_lightning.trainer_cli import MharCLI

        MharCLI(args=None if argv is None else args)
    except MharError as error:
        if os.environ.get("MHAR_TRACEBACK") == "1":
            raise
        print(f"mhar: error: {error}", file=sys.stderr)
        raise SystemExit(error.exit_code) from None


if __name__ == "__main__":
    main()
