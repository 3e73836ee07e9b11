"""`benchmarks/throughput.py`'s summary table: ratios to `sum` of the same repeat, worked out by hand."""

import importlib.util
import sys
from pathlib import Path

_DIR = Path(__file__).parents[1] / "benchmarks"
sys.path.insert(0, str(_DIR))  # the script imports `gpu_idle` from beside it
_SPEC = importlib.util.spec_from_file_location("throughput", _DIR / "throughput.py")
throughput = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(throughput)
sys.path.remove(str(_DIR))


def row(variant: str, repeat: int, tok_s: float, kernels_ms: float | None, opt_host: float) -> dict:
    r = {
        "preset": "350m",
        "precision": "autocast",
        "variant": variant,
        "repeat": repeat,
        "tok_s": tok_s,
        "tok_s_pipelined": tok_s * 1.1,
        "peak_gib": 20.0,
        "step_s": 16384 / tok_s,
        "host_s": 0.05,
        "compile_s": 60.0,
        "phase_ms": {"optimizer host": opt_host},
    }
    if kernels_ms is not None:
        r["kernels_ms"] = kernels_ms
    return r


def table(rows: list[dict], capsys) -> dict[str, list[str]]:
    """Each variant's cells (blank ones dropped), by variant."""
    throughput.print_summary(rows)
    header, *lines = capsys.readouterr().out.splitlines()
    assert header.split()[-6:] == ["opt", "host", "pipelined", "kernels", "compile", "s"]
    return {line.split()[2]: line.split() for line in lines}


def test_kernel_ratio_pairs_each_repeat_with_its_sum(capsys):
    rows = [
        row("sum", 0, 100.0, 80.0, 1.5),
        row("mhar", 0, 90.0, 100.0, 2.5),
        row("sum", 1, 100.0, 90.0, 1.9),
        row("mhar", 1, 90.0, 90.0, 3.5),
        row("sum", 2, 100.0, 85.0, 2.1),
        row("mhar", 2, 90.0, 100.0, 4.5),
    ]
    lines = table(rows, capsys)
    # optimizer host ms (median of 2.5, 3.5, 4.5), pipelined, kernels (80/100, 90/90, 85/100: median 0.85), compile s
    assert lines["mhar"][-4:] == ["3.50", "0.900", "0.850", "60.0"]
    assert lines["sum"][-4:] == ["1.90", "1.000", "1.000", "60.0"]


def test_kernel_ratio_blank_without_profile(capsys):
    lines = table([row("sum", 0, 100.0, None, 1.5), row("mhar", 0, 90.0, None, 2.0)], capsys)
    assert lines["mhar"][-3:] == ["2.00", "0.900", "60.0"]
