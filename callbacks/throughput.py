"""`TokenThroughputMonitor`: Lightning's `ThroughputMonitor` for [B, T + 1] token batches, ready for YAML."""

import lightning as L
import torch
from lightning.pytorch.callbacks import ThroughputMonitor
from torch import Tensor

H200_DENSE_PEAK = {"nvl": 835.5e12, "sxm": 989.4e12}
"""Dense bf16/fp16 tensor-core FLOP/s of the H200 (NVL, SXM) without sparsity (NVIDIA datasheet / 2)."""


def batch_rows(batch: Tensor) -> int:
    """Samples in a batch of token windows."""
    return batch.shape[0]


def batch_tokens(batch: Tensor) -> int:
    """Trained tokens in a [B, T + 1] batch: B * T (inputs and targets are shifted views of one window)."""
    return batch.shape[0] * (batch.shape[1] - 1)


class TokenThroughputMonitor(ThroughputMonitor):
    """Tokens/s, samples/s, FLOP/s and MFU of training, from the LightningModule's `flops_per_batch`.

    Logged as `train/device/items_per_sec` (tokens/s per device), `train/device/samples_per_sec`,
    `train/device/flops_per_sec` and `train/device/mfu` (plus `train/items_per_sec` etc. when world size > 1),
    averaged over the last `window_size` steps, so nothing is logged before `window_size` steps.
    `LanguageModel.flops_per_batch` = `ModelConfig.flops_per_token(T) * B * T` with
    `flops_per_token = 6 * (matmul parameters, LM head included) + 12 * n_layers * d_model * T`
    (PaLM/Chinchilla, causal-agnostic attention; depth routing is not counted).

    MFU = achieved FLOP/s per device / peak FLOP/s of the device for the trainer's precision, the peak from
    Lightning's table (`lightning.fabric.utilities.throughput.get_available_flops`): H100 SXM bf16 989.4e12
    (dense). Lightning does not recognise the name "NVIDIA H200" (it expects "sxm1"/"nvl1" in it, and its H200
    entries are the 2:4-sparse figures), so for H200 this callback uses the dense bf16/fp16 peak 989.4e12
    (SXM) or 835.5e12 (NVL). `peak_flops` overrides the peak for any device.

    Args:
        window_size: steps in the rolling average.
        peak_flops: peak FLOP/s of one device (None: looked up as above; no MFU where unknown, e.g. CPU).
    """

    def __init__(self, window_size: int = 20, peak_flops: float | None = None) -> None:
        super().__init__(batch_size_fn=batch_rows, length_fn=batch_tokens, window_size=window_size)
        self.peak_flops = peak_flops

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        peak = self.peak_flops or self.available_flops or h200_peak(trainer.strategy.root_device, trainer.precision)
        self.available_flops = peak
        for throughput in self._throughputs.values():
            throughput.available_flops = peak


def h200_peak(device: torch.device, precision: str) -> float | None:
    """Dense bf16/fp16 peak of an H200, or None for other devices and precisions."""
    if device.type != "cuda" or not any(p in str(precision) for p in ("bf16", "16-")):
        return None
    name = torch.cuda.get_device_name(device).lower()
    if "h200" not in name:
        return None
    return H200_DENSE_PEAK["nvl" if "nvl" in name else "sxm"]
