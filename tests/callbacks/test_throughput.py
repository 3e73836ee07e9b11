"""TokenThroughputMonitor: token counts of [B, T + 1] batches, windows read without waiting for the device, and the
dense H200 peak Lightning lacks."""

import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import Logger
from mhar_lightning.callbacks import PeakMemoryMonitor, TokenThroughputMonitor, throughput
from mhar_lightning.callbacks.throughput import batch_rows, batch_tokens, device_peak, h200_peak

from mhar_lightning.data import TokenDataModule
from mhar_lightning.module import LanguageModel


def test_batches_count_rows_and_predicted_tokens():
    batch = torch.zeros(4, 129, dtype=torch.long)
    assert batch_rows(batch) == 4 and batch_tokens(batch) == 4 * 128


class MetricsLogger(Logger):
    """Keeps every logged metric with its step."""

    name, version = "memory", 0

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int, dict]] = []

    def log_metrics(self, metrics, step=None) -> None:
        self.logged.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


@pytest.mark.usefixtures("default_corpus")
def test_windows_of_steps_are_logged_one_window_late(tmp_path, monkeypatch):
    """Seven steps in windows of two: each window's tokens, samples and FLOPs over its clock time, logged at the
    step that ends it once the next window has ended (the last ones at the end of training). The first step, which
    compiles, is left out, so the first window holds only step 2, and the steps after the last full window make a
    window of their own (step 7). The clock ticks one second per mark, so each window lasts exactly one second."""
    ticks = iter(range(100))
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: float(next(ticks)))
    logger = MetricsLogger()
    model = LanguageModel(preset="tiny", vocab_size=256, seq_len=16)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=7,
        limit_val_batches=0,
        logger=logger,
        callbacks=[TokenThroughputMonitor(window_size=2)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=TokenDataModule(tokenizer="byte", seq_len=16, batch_size=4, val_samples=8))
    windows = [(step, m) for step, m in logger.logged if "train/device/items_per_sec" in m]
    assert [step for step, _ in windows] == [2, 4, 6, 7]
    flops = model.model_config.flops_per_token(16) * 4 * 16
    for (step, metrics), steps in zip(windows, (1, 2, 2, 1), strict=True):
        assert metrics["train/device/items_per_sec"] == steps * 4 * 16, step
        assert metrics["train/device/samples_per_sec"] == steps * 4
        assert metrics["train/device/flops_per_sec"] == steps * flops
        assert "train/device/mfu" not in metrics  # no known peak on a CPU


@pytest.mark.parametrize(
    ("name", "dtype", "peak"),
    [
        ("NVIDIA H200", torch.bfloat16, 989.4e12),
        ("NVIDIA H200 NVL", torch.float16, 835.5e12),
        ("NVIDIA H200", torch.float32, None),
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, None),  # Lightning's own table covers the H100
    ],
)
def test_h200_dense_peak(monkeypatch, name, dtype, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert h200_peak(torch.device("cuda", 0), dtype) == peak
    assert h200_peak(torch.device("cpu"), dtype) is None


class ShardedModule(L.LightningModule):
    """Stands in for `LanguageModel` under FSDP2: fp32 master weights (precision 32-true), bf16 compute."""

    compute_dtype = torch.bfloat16


@pytest.mark.parametrize(
    ("name", "precision", "module", "peak"),
    [
        ("NVIDIA H200", "bf16-mixed", None, 989.4e12),
        ("NVIDIA H100 80GB HBM3", "bf16-mixed", None, 989.4e12),
        ("NVIDIA H200", "32-true", ShardedModule(), 989.4e12),
        ("NVIDIA H200", "32-true", None, None),
    ],
)
def test_the_device_peak_comes_without_warnings_where_the_compute_dtype_has_one(
    monkeypatch, name, precision, module, peak
):
    trainer = L.Trainer(accelerator="cpu", precision=precision, logger=False, enable_progress_bar=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert device_peak(torch.device("cuda", 0), trainer, module) == peak
    assert [str(w.message) for w in caught if "FLOPs" in str(w.message)] == ([] if peak else [
        "FLOPs not found for 'NVIDIA H200', chip is 'nvidia h200'"
    ])  # fmt: skip


def test_a_sharded_language_model_computes_in_its_param_dtype():
    model = LanguageModel(param_dtype="bfloat16")
    assert model.compute_dtype is None  # whole: the Trainer's precision decides
    model._device_mesh = object()
    assert model.compute_dtype is torch.bfloat16


def test_constructors_need_no_arguments():
    assert PeakMemoryMonitor().log_every_n_steps is None
    assert TokenThroughputMonitor().peak_flops is None
