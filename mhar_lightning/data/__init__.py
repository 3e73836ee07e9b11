"""Token data: tokenizers, text prepared into checked token shards, the default corpus, and the Lightning datamodule."""

from mhar_lightning.data.datamodule import TokenDataModule
from mhar_lightning.data.dataset import TokenWindowDataset
from mhar_lightning.data.shards import ShardError, ShardIndex, TokenStream

__all__ = ["ShardError", "ShardIndex", "TokenDataModule", "TokenStream", "TokenWindowDataset"]
