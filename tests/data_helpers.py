"""Shared by the data tests: split a token shard back into documents."""

import numpy as np

from mhar_lightning.data.shards import TokenStream
from mhar_lightning.data.tokenizer import Tokenizer


def split_documents(stream: TokenStream, tokenizer: Tokenizer) -> list[list[int]]:
    """The token ids of each document in a split, without their EOT separators."""
    ids = stream[0 : len(stream)]
    cuts = np.flatnonzero(ids == tokenizer.eot_id)
    assert len(cuts) and cuts[-1] == len(ids) - 1, "every document ends with EOT"
    return [chunk[:-1].tolist() for chunk in np.split(ids, cuts + 1)[:-1]]
