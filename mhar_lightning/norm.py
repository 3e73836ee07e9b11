"""RMSNorm in the Llama formulation, as a function (shared with the fused merge kernels' reference) and a module."""

import torch
from torch import Tensor, nn


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """weight * x / RMS(x): statistics in fp32, the normalised row rounded to x's dtype before the weight."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)).type_as(x)


class RMSNorm(nn.Module):
    """RMSNorm with fp32 statistics (the Llama formulation)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)
