"""Token data: tokenizers, text prepared into checked token shards, the default corpus, and the Lightning datamodule."""

import importlib
from typing import Any

from mhar_lightning.data.shards import ShardError, ShardIndex, TokenStream

__all__ = ["ShardError", "ShardIndex", "TokenDataModule", "TokenStream", "TokenWindowDataset"]
LAZY = {"TokenDataModule": "mhar_lightning.data.datamodule", "TokenWindowDataset": "mhar_lightning.data.dataset"}
"""Imported when first asked for (they load torch and Lightning), so that `mhar prepare` starts at once."""


def __getattr__(name: str) -> Any:
    if name not in LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(LAZY[name]), name)
