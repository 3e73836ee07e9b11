"""Shared by the residual and probe tests: routing parameters moved away from their neutral initialisation."""

import torch

from mhar_lightning.model import Decoder


def randomize_routing(model: Decoder, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "residual" in name:
                p.copy_(torch.randn(p.shape, generator=g))
