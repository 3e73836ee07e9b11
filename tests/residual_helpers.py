"""Shared by the residual and probe tests: routing parameters moved away from their neutral initialisation, and a
third-party strategy installed with an entry point."""

from pathlib import Path

import torch

from mhar_lightning.model import Decoder


def randomize_routing(model: Decoder, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "residual" in name:
                p.copy_(torch.randn(p.shape, generator=g))


PLUGIN = '''
import torch
from torch import nn

from mhar_lightning.residual import Residual


class ReZero(Residual):
    """h <- h + alpha_l * y_l with alpha_l starting at `init`."""

    def __init__(self, init: float = 0.0) -> None:
        super().__init__()
        self.init = init

    def build(self, config):
        self.alpha = nn.Parameter(torch.empty(len(self.sites)))

    def reset_parameters(self):
        if hasattr(self, "alpha"):
            nn.init.constant_(self.alpha, self.init)

    def read(self, stream, l):
        return stream[0]

    def write(self, stream, l, y):
        return (stream[0] + self.alpha[self.site(l)] * y,)
'''


def install_plugin(site: Path) -> Path:
    """`site` as a site-packages directory holding an installed `rezero-plugin` distribution: its module and the
    `.dist-info` that pip writes, whose entry points `importlib.metadata` finds on `sys.path` as for any package."""
    info = site / "rezero_plugin-0.1.dist-info"
    info.mkdir(parents=True)
    (site / "rezero_plugin.py").write_text(PLUGIN)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rezero-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[mhar_lightning.residuals]\nrezero = rezero_plugin:ReZero\nbroken = rezero_plugin_missing:ReZero\n"
    )
    return site
