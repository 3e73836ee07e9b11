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


def quiet_third_party_noise() -> None:
    """Drop Lightning's LitLogger tip, its end-of-fit message (see `DROPPED_MESSAGES`) and the warnings the user can
    do nothing about."""
    for message in QUIETED_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_NoAdverts())
