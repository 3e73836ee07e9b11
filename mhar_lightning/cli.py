"""The `mhar` command: the Trainer subcommands (fit, validate, test) and the kit's tools (prepare, compare, ...).

Only the subcommand that runs is imported: a tool such as `mhar prepare`, or `mhar --help`, starts without loading
Lightning.
"""

import os
import signal
import sys
from collections.abc import Sequence

from mhar_lightning.errors import MharError
from mhar_lightning.terminal import quiet_third_party_noise
from mhar_lightning.tools import TOOLS, run_tool

TRAINER_COMMANDS = {
    "fit": "Train: `mhar fit --config RECIPE [--section.key value ...]`.",
    "validate": "Validate a checkpoint: `mhar validate --config RECIPE --ckpt_path CKPT`.",
    "test": "Refused: prepared data has train and val splits only, no test split; use `mhar validate`.",
}
"""The Trainer's subcommands, run by `MharCLI` (LightningCLI)."""
TOOL_ERROR = 1
"""What a tool returns after printing its one-line error; `mhar` exits with `MharError.exit_code` instead, the exit
code of every user error."""
STOPPED_BY_SIGTERM = 128 + signal.SIGTERM
"""Exit code of a run stopped by SIGTERM (the shell's convention), so a job scheduler or `mhar compare` never takes
it for a finished one."""


def usage() -> str:
    """`mhar --help`: every subcommand in one screen, without building the Trainer's parser."""
    lines = ["usage: mhar SUBCOMMAND [options]   (`mhar SUBCOMMAND --help` lists its options)", ""]
    lines += ["Trainer subcommands (a recipe and any of its settings):"]
    lines += [f"    {name:<12} {text}" for name, text in TRAINER_COMMANDS.items()]
    lines += ["", "Tools:"]
    lines += [f"    {name:<12} {text}" for name, (_, _, text) in TOOLS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the `mhar` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args in (["-h"], ["--help"]):
        print(usage())
        raise SystemExit(0)
    if not args:
        error = "mhar: error: name a subcommand, e.g. `mhar fit --config recipes/demo.yaml`"
        print(usage(), "", error, sep="\n", file=sys.stderr)
        raise SystemExit(2)
    quiet_third_party_noise()
    try:
        if args[0] in TOOLS:
            code = run_tool(args[0], args[1:])
            raise SystemExit(MharError.exit_code if code == TOOL_ERROR else code)
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        from mhar_lightning.trainer_cli import MharCLI

        try:
            MharCLI(args=None if argv is None else args)
        except SIGTERMException as stop:  # a SystemExit without an int code: the process would exit 0 as if done
            report = stop.code if isinstance(stop.code, str) else "stopped by SIGTERM"
            print(f"mhar: {report}; resume with --ckpt_path last", file=sys.stderr)
            raise SystemExit(STOPPED_BY_SIGTERM) from None
    except MharError as error:
        if os.environ.get("MHAR_TRACEBACK") == "1":
            raise
        print(f"mhar: error: {error}", file=sys.stderr)
        raise SystemExit(error.exit_code) from None


if __name__ == "__main__":
    main()
