"""`BitsPerByte` against per-token cross-entropy: special tokens (no bytes) are left out, batches and ranks sum."""

import math

import pytest
import torch
import torch.nn.functional as F

from mhar_lightning.bits_per_byte import BitsPerByte


def test_bits_per_byte_leaves_out_special_tokens_and_sums_batches():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 5, (50,), generator=g)
    lengths[[0, 7]] = 0  # two special tokens
    weight = torch.randn(50, 16, generator=g)
    meter, nats, total_bytes = BitsPerByte(lengths), 0.0, 0
    for _ in range(3):
        hidden = torch.randn(2, 12, 16, generator=g)
        targets = torch.randint(0, 50, (2, 12), generator=g)
        targets[0, [3, 5]], targets[1, 0] = 0, 7
        per_token = F.cross_entropy((hidden @ weight.T).flatten(0, 1), targets.flatten(), reduction="none").view(2, 12)
        meter.update(hidden, weight, targets, per_token.mean(), chunk_tokens=5)
        nats += per_token[lengths[targets] > 0].sum().item()
        total_bytes += lengths[targets].sum().item()
    assert meter.value() == pytest.approx(nats / math.log(2) / total_bytes, rel=1e-6)
    assert meter.value(lambda sums: 2 * sums) == pytest.approx(meter.value(), rel=1e-12)  # two equal ranks
    meter.reset()
    assert meter.value() is None
