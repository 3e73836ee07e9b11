"""`MuonAdamW`: torch's Muon for the hidden matrices and AdamW for the other parameters, as one optimizer."""

from typing import Any

import torch


def muon_class() -> type[torch.optim.Optimizer]:
    """`torch.optim.Muon`, or a one-line error naming the torch release that has it."""
    muon = getattr(torch.optim, "Muon", None)
    if muon is None:
        raise ValueError(
            f"model.optimizer.name=muon needs torch.optim.Muon (torch >= 2.9) and this is torch {torch.__version__}:"
            " upgrade torch or use model.optimizer.name=adamw"
        )
    return muon


class MuonAdamW(torch.optim.Optimizer):
    """`torch.optim.Muon` over `muon_groups` and `torch.optim.AdamW` over `adamw_groups`, stepped, scheduled and
    checkpointed as one optimizer (Lightning's automatic optimization takes one).

    Its `param_groups` are the Muon groups, then the AdamW groups: the very dicts the two optimizers step with, so a
    learning-rate scheduler drives both. Both keep their per-parameter state in this optimizer's `state`, so
    `state_dict` and `load_state_dict` (and torch's distributed checkpoint helpers) see every parameter's state.
    """

    def __init__(
        self,
        muon_groups: list[dict[str, Any]],
        adamw_groups: list[dict[str, Any]],
        muon_options: dict[str, Any],
        adamw_options: dict[str, Any],
    ) -> None:
        self.muon = muon_class()(muon_groups, **muon_options)
        self.adamw = torch.optim.AdamW(adamw_groups, **adamw_options)
        super().__init__([*self.muon.param_groups, *self.adamw.param_groups], {})
        self._share()

    def _share(self) -> None:
        """Point the two optimizers at this one's groups and state (after `load_state_dict` replaced them)."""
        split = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:split], self.param_groups[split:]
        self.muon.state = self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._share()
