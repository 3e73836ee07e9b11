"""Keep the terminal to what helps the user: no advert, no warnings about other libraries' internals."""

import logging
import warnings

QUIETED_WARNINGS = (
    "'set_vital' is deprecated",  # torchdata's StatefulDataLoader calls a deprecated torch function
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",  # Lightning's pytree helper, on torch >= 2.9
    # `mhar fit` refuses a fresh run into a folder holding checkpoints; a resumed run's folder holds them
    "Checkpoint directory .* exists and is not empty",
)


DROPPED_MESSAGES = (
    "Tip:",  # Lightning's advert for LitLogger
    "`Trainer.fit` stopped:",  # printed over the progress bar; the kit's `RunSummary` closes a run instead
)


class _NoAdverts(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(message in str(record.msg) for message in DROPPED_MESSAGES)


class HeldStartupLines(logging.Handler):
    """Holds Lightning's start-up lines (the seed, the devices, the precision) until the run starts, so a run refused
    while it is being set up prints its one-line error alone."""

    LOGGERS = ("lightning.pytorch", "lightning.fabric")

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.saved: dict[str, list[logging.Handler]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> "HeldStartupLines":
        for name in self.LOGGERS:
            logger = logging.getLogger(name)
            self.saved[name], logger.handlers = logger.handlers, [self]
        return self

    def end(self, show: bool = True) -> None:
        """Give the loggers their handlers back and, if `show`, print what was held (only the first call does)."""
        records, self.records = self.records, []
        for name, handlers in self.saved.items():
            logging.getLogger(name).handlers = handlers
        if show:
            for record in records:
                for name, handlers in self.saved.items():
                    if record.name == name or record.name.startswith(name + "."):
                        for handler in handlers:
                            if record.levelno >= handler.level:
                                handler.handle(record)
        self.saved = {}

    def __exit__(self, kind, error, traceback) -> None:
        self.end(show=error is None)


def quiet_third_party_noise() -> None:
    """Drop Lightning's LitLogger tip, its end-of-fit message (see `DROPPED_MESSAGES`) and the warnings the user can
    do nothing about."""
    for message in QUIETED_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_NoAdverts())
