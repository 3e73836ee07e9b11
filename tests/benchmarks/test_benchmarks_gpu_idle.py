"""`benchmarks/gpu_idle.py`: the split of a trace's GPU idle time, against a hand-built trace worked out by hand."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).parents[2] / "benchmarks" / "gpu_idle.py"
_SPEC = importlib.util.spec_from_file_location("gpu_idle", _PATH)
gpu_idle = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(gpu_idle)


def event(cat: str, name: str, ts: float, dur: float, tid: int = 1, correlation: int | None = None) -> dict:
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}
    if correlation is not None:
        e["args"] = {"correlation": correlation}
    return e


def trace() -> list[dict]:
    """A forward on thread 1 and a backward launched from thread 2, on one stream (times in us):

    k1 runs 10-20. k2 is launched at 60-65 (the host was in `route` 22-58 and `aten::mm` 58-66) and runs 70-80:
    a host-bound gap of 50 us, of which `route` overlaps 36 us, `aten::mm` 2 and `outer` 40. k3 was launched at 66,
    well before k2 ended, and starts at 90: a GPU-side gap of 10 us. k4 is launched from thread 2 at 130-132 and runs
    140-150 after k3's 90-100: a host-bound backward gap of 40 us, overlapped by thread 2's `engine` (0-200, so 30 us)
    and not by thread 1's `late` (100-140). A memset right after k4 leaves a gap of 1 us, under the minimum.
    """
    return [
        event("user_annotation", "phase_forward", 0, 100),
        event("user_annotation", "phase_backward", 100, 100),
        event("cpu_op", "outer", 20, 40),
        event("cpu_op", "route", 22, 36),
        event("cpu_op", "aten::mm", 58, 8),
        event("cpu_op", "late", 100, 40),
        event("cpu_op", "engine", 0, 200, tid=2),
        event("cuda_runtime", "cudaLaunchKernel", 5, 3, correlation=1),
        event("cuda_driver", "cuLaunchKernel", 60, 5, correlation=2),
        event("cuda_runtime", "cudaLaunchKernel", 66, 2, correlation=3),
        event("cuda_runtime", "cudaLaunchKernel", 130, 2, tid=2, correlation=4),
        event("kernel", "k1", 10, 10, tid=7, correlation=1),
        event("kernel", "k2", 70, 10, tid=7, correlation=2),
        event("kernel", "k3", 90, 10, tid=7, correlation=3),
        event("kernel", "k4", 140, 10, tid=7, correlation=4),
        event("gpu_memset", "Memset", 151, 1, tid=7),
    ]


def test_idle_time_is_split_by_phase_and_cause():
    report = gpu_idle.analyse(trace())
    assert report.span_us == pytest.approx(142)
    assert report.busy_us == pytest.approx(41)
    assert report.idle_us == pytest.approx({("forward", True): 50, ("forward", False): 10, ("backward", True): 40})
    assert [(g.us, g.next_kernel, g.host_bound) for g in report.gaps] == [
        (50, "k2", True),
        (10, "k3", False),
        (40, "k4", True),
    ]
    assert dict(report.host_ops_us) == pytest.approx({"outer": 40, "route": 36, "aten::mm": 2, "engine": 30})
    assert report.runtime["cudaLaunchKernel"] == (3, 7, 3)
    assert report.runtime["cuLaunchKernel"] == (1, 5, 5)


def test_gzipped_trace_from_the_profiler_keeps_the_phases(tmp_path):
    """The real profiler's chrome trace (CPU here) carries `phase_range` marks, and a trace without GPU events gets
    a clear error."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with gpu_idle.phase_range("forward"):
            torch.randn(64, 64).mm(torch.randn(64, 64))
    path = str(tmp_path / "step.json.gz")
    prof.export_chrome_trace(path)
    events = gpu_idle.load_events(path)
    assert [e["cat"] for e in events if e["name"] == "phase_forward"] == ["user_annotation"]
    assert any(e["name"] == "aten::mm" for e in events)
    with pytest.raises(ValueError, match="no GPU events in the trace: profile on a GPU"):
        gpu_idle.analyse(events)


def test_plain_json_trace_loads(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": [*trace(), {"ph": "i", "name": "instant", "ts": 1}]}))
    assert len(gpu_idle.load_events(str(path))) == len(trace())
