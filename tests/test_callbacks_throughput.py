"""TokenThroughputMonitor: token counts of [B, T + 1] batches and the dense H200 peak Lightning lacks."""

import pytest
import torch
from mhar_lightning.callbacks import PeakMemoryMonitor, TokenThroughputMonitor
from mhar_lightning.callbacks.throughput import batch_rows, batch_tokens, h200_peak


def test_batches_count_rows_and_predicted_tokens():
    batch = torch.zeros(4, 129, dtype=torch.long)
    assert batch_rows(batch) == 4 and batch_tokens(batch) == 4 * 128
    monitor = TokenThroughputMonitor()
    assert monitor.batch_size_fn is batch_rows and monitor.length_fn is batch_tokens


@pytest.mark.parametrize(
    ("name", "precision", "peak"),
    [
        ("NVIDIA H200", "bf16-mixed", 989.4e12),
        ("NVIDIA H200 NVL", "bf16-true", 835.5e12),
        ("NVIDIA H200", "32-true", None),
        ("NVIDIA H100 80GB HBM3", "bf16-mixed", None),  # Lightning's own table covers the H100
    ],
)
def test_h200_dense_peak(monkeypatch, name, precision, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert h200_peak(torch.device("cuda", 0), precision) == peak
    assert h200_peak(torch.device("cpu"), precision) is None


def test_constructors_need_no_arguments():
    assert PeakMemoryMonitor().log_every_n_steps is None
    assert TokenThroughputMonitor().peak_flops is None
