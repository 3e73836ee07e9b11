"""Shared by the tokenizer/data tests: an offline, cache-free environment and a shard decoder."""

import socket

import numpy as np
import pytest

from mhar_lightning.data.shards import TokenStream
from mhar_lightning.tokenizer import Tokenizer


@pytest.fixture(autouse=True)
def offline_env(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point MHAR/tiktoken cache variables at empty temp folders and make any network connection fail."""
    root = tmp_path_factory.mktemp("env")
    for var in ("MHAR_CACHE_DIR", "TIKTOKEN_CACHE_DIR", "MHAR_TIKTOKEN_DIR"):
        monkeypatch.setenv(var, str(root / var.lower()))
    monkeypatch.delenv("DATA_GYM_CACHE_DIR", raising=False)

    connect = socket.socket.connect

    def guarded_connect(sock: socket.socket, address: object) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6):  # local (Unix) sockets stay usable for workers
            raise AssertionError(f"a test tried to open a network connection to {address}")
        connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", guarded_connect)


def split_documents(stream: TokenStream, tokenizer: Tokenizer) -> list[list[int]]:
    """The token ids of each document in a split, without their EOT separators."""
    ids = stream[0 : len(stream)]
    cuts = np.flatnonzero(ids == tokenizer.eot_id)
    assert len(cuts) and cuts[-1] == len(ids) - 1, "every document ends with EOT"
    return [chunk[:-1].tolist() for chunk in np.split(ids, cuts + 1)[:-1]]
