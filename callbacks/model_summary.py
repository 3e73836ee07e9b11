"""`ParameterSummary`: the model's size in one line before training, in place of Lightning's table."""

import lightning as L
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.model_summary import get_human_readable_count

from mhar_lightning.parallel import routing_parameters, unsharded_parameter_count


class ParameterSummary(L.Callback):
    """Print, before training, the decoder's parameters, how many of them the residual strategy adds, and the size
    of their fp32 copy, e.g. `model: 322 M parameters (routing 12.3 K), 1,229.0 MiB in fp32`.

    Lightning's table lists the strategy template beside the decoder and a FLOPs column that is 0 for a model without
    an example input; the kit's throughput monitor reports FLOP/s and MFU instead.
    """

    @rank_zero_only
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        decoder = getattr(pl_module, "decoder", None) or pl_module
        total = unsharded_parameter_count(decoder)
        routing = routing_parameters(decoder)
        print(
            f"model: {get_human_readable_count(total)} parameters (routing {get_human_readable_count(routing)}), "
            f"{total * 4 / 2**20:,.1f} MiB in fp32",
            flush=True,
        )
