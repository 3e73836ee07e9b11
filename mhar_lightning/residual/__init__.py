"""Residual strategies as plugins: the `Residual` contract, the built-ins and the name registry."""

from mhar_lightning.residual.base import RESIDUALS, Residual, Stream, make_residual, register_residual
from mhar_lightning.residual.delta import DeltaMHAR
from mhar_lightning.residual.routed import MHAR, AttnRes, DepthRouter, capture_depth_attention
from mhar_lightning.residual.sum import SumResidual

__all__ = [
    "RESIDUALS",
    "AttnRes",
    "DeltaMHAR",
    "DepthRouter",
    "MHAR",
    "Residual",
    "Stream",
    "SumResidual",
    "capture_depth_attention",
    "make_residual",
    "register_residual",
]
