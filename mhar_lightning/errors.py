"""Errors `mhar` prints as one line naming the fix (a traceback only with MHAR_TRACEBACK=1), and their exit codes."""


class MharError(Exception):
    """An error the user can act on: `mhar` prints `mhar: error: <message>` and exits with `exit_code`."""

    exit_code = 2


class ConfigError(MharError, ValueError):
    """A configuration that must not start training; the message names the fix."""


class CheckpointError(MharError, ValueError):
    """A checkpoint that cannot be used as given (missing, damaged, non-finite, or contradicting the config)."""


class TrainingDiverged(MharError, RuntimeError):
    """A non-finite loss or gradient norm stopped training before its optimizer step; no checkpoint holds it."""

    exit_code = 3
