"""`TokenThroughputMonitor`: tokens/s, FLOP/s and MFU of training, measured without stalling the GPU."""

import time
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.throughput import get_available_flops
from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype
from mhar_lightning.callbacks.base import log_scalars
from torch import Tensor

H200_DENSE_PEAK = {"nvl": 835.5e12, "sxm": 989.4e12}
"""Dense bf16/fp16 tensor-core FLOP/s of the H200 (NVL, SXM) without sparsity (NVIDIA datasheet / 2)."""


def batch_rows(batch: Tensor) -> int:
    """Samples in a batch of token windows."""
    return batch.shape[0]


def batch_tokens(batch: Tensor) -> int:
    """Trained tokens in a [B, T + 1] batch: B * T (inputs and targets are shifted views of one window)."""
    return batch.shape[0] * (batch.shape[1] - 1)


class _Clock:
    """Marks on the device's stream (CUDA events) or on the host clock (CPU), read without waiting for the device."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()  # recorded a window ago, long finished (or at the end of training): no stall
        return start.elapsed_time(end) * 1e-3


class TokenThroughputMonitor(L.Callback):
    """Log tokens/s, samples/s, FLOP/s and MFU of training, each averaged over a window of `window_size` steps.

    Lightning's `ThroughputMonitor` synchronises the GPU after every step, which takes away the host's lead over
    the GPU and costs a compiled model several per cent of its speed. Here the window's ends are CUDA events on the
    training stream, and a window is read one window later, when its end event has long completed, so measuring
    never waits for the GPU. The run's first optimizer step, which holds the compilation, is left out: the first
    window starts after it; the steps after the last full window are a shorter window at the end. Logged on global
    rank 0 at the step that ends each window, as `train/device/items_per_sec` (tokens/s per device),
    `train/device/samples_per_sec`, `train/device/flops_per_sec` and `train/device/mfu`, plus `train/items_per_sec`,
    `train/samples_per_sec` and `train/flops_per_sec` over all devices when there are several. `latest` holds the
    last logged values (on rank 0), which the progress bar shows.

    FLOPs come from the LightningModule's `flops_per_batch` (`LanguageModel`: `ModelConfig.flops_per_token(T) * B * T`,
    `6 * matmul parameters + 12 * n_layers * d_model * T`; depth routing is not counted). MFU divides by the dense peak
    of the device for the compute dtype (FSDP2's `param_dtype` when sharded, else the trainer's precision):
    Lightning's table, or the H200's dense bf16 peak (989.4e12 SXM, 835.5e12 NVL), which Lightning's table lacks;
    `peak_flops` overrides it for any device.

    Args:
        window_size: optimizer steps per measured window.
        peak_flops: peak FLOP/s of one device (None: looked up as above; no MFU where unknown, e.g. CPU).
    """

    def __init__(self, window_size: int = 20, peak_flops: float | None = None) -> None:
        if window_size < 1:
            raise ValueError(f"window_size must be >= 1, got {window_size}")
        self.window_size = window_size
        self.peak_flops = peak_flops
        self._clock: _Clock | None = None
        self._marks: list[tuple[int, Any, int, int, float]] = []  # (step, mark, samples, tokens, flops) at window ends
        self._start_step = 0
        self._samples = self._tokens = 0
        self._flops = 0.0
        self.latest: dict[str, float] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._clock = _Clock(trainer.strategy.root_device)
        self._samples = self._tokens = 0
        self._flops = 0.0
        self._start_step = trainer.global_step
        self._marks = []
        self.latest = {}
        self._peak = self.peak_flops or device_peak(trainer.strategy.root_device, trainer, pl_module)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if not self._marks:  # the run's first optimizer step (it holds the compilation) is not measured
            if step > self._start_step:
                self._marks = [(step, self._clock.mark(), 0, 0, 0.0)]
            return
        self._samples += batch_rows(batch)
        self._tokens += batch_tokens(batch)
        self._flops += float(getattr(pl_module, "flops_per_batch", 0) or 0)
        if step == self._marks[-1][0] or step % self.window_size:
            return
        self._add_mark(step)
        if len(self._marks) > 2:  # the window before this one has surely finished on the device
            self._log(trainer, *self._marks[-3:-1])
            self._marks.pop(0)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._marks and trainer.global_step > self._marks[-1][0]:  # a last, shorter window
            self._add_mark(trainer.global_step)
            if len(self._marks) > 2:
                self._log(trainer, *self._marks[-3:-1])
        if len(self._marks) > 1:
            self._log(trainer, *self._marks[-2:])

    def _add_mark(self, step: int) -> None:
        self._marks.append((step, self._clock.mark(), self._samples, self._tokens, self._flops))

    def _log(self, trainer: L.Trainer, start: tuple, end: tuple) -> None:
        seconds = self._clock.seconds(start[1], end[1])
        if not trainer.is_global_zero or seconds <= 0:
            return
        samples, tokens, flops = ((e - s) / seconds for s, e in zip(start[2:], end[2:]))
        metrics = {
            "train/device/items_per_sec": tokens,
            "train/device/samples_per_sec": samples,
            "train/device/flops_per_sec": flops,
        }
        if self._peak:
            metrics["train/device/mfu"] = flops / self._peak
        if trainer.world_size > 1:
            for name in ("items_per_sec", "samples_per_sec", "flops_per_sec"):
                metrics[f"train/{name}"] = metrics[f"train/device/{name}"] * trainer.world_size
        self.latest = metrics
        log_scalars(trainer, metrics, end[0])


def device_peak(device: torch.device, trainer: L.Trainer, pl_module: L.LightningModule | None = None) -> float | None:
    """Dense peak FLOP/s of `device` at the run's compute dtype (the module's own under FSDP2's mixed precision,
    else the trainer's): the H200's, which Lightning's table lacks (asked, it warns on every run), else Lightning's."""
    if device.type != "cuda":
        return None
    dtype = getattr(pl_module, "compute_dtype", None) or _plugin_to_compute_dtype(trainer.precision_plugin)
    return h200_peak(device, dtype) or get_available_flops(device, dtype)


def h200_peak(device: torch.device, dtype: torch.dtype) -> float | None:
    """Dense bf16/fp16 peak of an H200, or None for other devices and dtypes."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    name = torch.cuda.get_device_name(device).lower()
    if "h200" not in name:
        return None
    return H200_DENSE_PEAK["nvl" if "nvl" in name else "sxm"]
