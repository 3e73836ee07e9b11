"""Residual strategies as plugins: the `Residual` contract, the built-ins and the name registry."""

from mhar_lightning.residual.base import (
    ENTRY_POINT_GROUP,
    RESIDUALS,
    Residual,
    SiteCapture,
    Stream,
    capture_sites,
    make_residual,
    register_residual,
    residual_name,
    sublayer_label,
)
from mhar_lightning.residual.delta import DeltaMHAR
from mhar_lightning.residual.hyper import HyperConnections
from mhar_lightning.residual.routed import MHAR, AttnRes, DepthRouter
from mhar_lightning.residual.sum import SumResidual

__all__ = [
    "ENTRY_POINT_GROUP",
    "RESIDUALS",
    "AttnRes",
    "DeltaMHAR",
    "DepthRouter",
    "HyperConnections",
    "MHAR",
    "Residual",
    "SiteCapture",
    "Stream",
    "SumResidual",
    "capture_sites",
    "make_residual",
    "register_residual",
    "residual_name",
    "sublayer_label",
]
