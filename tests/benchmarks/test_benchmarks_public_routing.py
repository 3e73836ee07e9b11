"""`benchmarks/public_routing.py`: the numerics check that decides whether a kernel is timed (in the Triton interpreter
on tiny shapes, against stand-in kernels and liger-kernel's when it is installed), the byte floor, the table, the
kept rows and the command's errors. The timings themselves need a GPU."""

import functools
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from mhar_lightning.kernels import reference

_PATH = Path(__file__).parents[2] / "benchmarks" / "public_routing.py"
sys.path.insert(0, str(_PATH.parent))  # the script imports its sibling `routing.py`, as it does when run
_SPEC = importlib.util.spec_from_file_location("public_routing", _PATH)
public_routing = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(public_routing)

TOKENS, D, S = 16, 64, 3


@pytest.fixture
def inputs():
    torch.manual_seed(0)
    sources, query, gain = public_routing.make(TOKENS, D, S, mixed=False, device="cpu")
    go = torch.randn(TOKENS, D, dtype=torch.bfloat16)
    want = public_routing.outputs(public_routing.bind_kit(1)(sources, query, gain), go)
    return sources, query, gain, go, want


def bind_reference(heads: int):
    """The pure-PyTorch route at `heads` heads, as a public kernel would be bound."""
    return lambda sources, query, gain: public_routing.Bound(
        lambda: reference.depth_route(sources, query, gain, heads), [*sources, query, gain]
    )


def test_a_kernel_with_the_same_math_is_timed_and_one_without_is_refused(inputs) -> None:
    entry, bound = public_routing.check(bind_reference(1), *inputs)
    assert entry["status"] == "ok" and bound is not None
    assert set(entry["diff"]) == {"out", "sources", "query", "gain"}
    assert max(entry["diff"].values()) <= public_routing.TOLERANCE
    entry, bound = public_routing.check(bind_reference(2), *inputs)  # two softmaxes over depth: other math
    assert entry["status"] == "refused" and bound is None
    assert max(entry["diff"].values()) > 10 * public_routing.TOLERANCE


def test_a_kernel_that_fails_or_is_missing_is_a_result(inputs) -> None:
    def broken(sources, query, gain):
        raise RuntimeError("out of resources\nmore detail")

    assert public_routing.check(broken, *inputs) == (
        {"status": "failed", "note": "RuntimeError: out of resources"},
        None,
    )
    assert public_routing.check("liger: not installed", *inputs) == (
        {"status": "missing", "note": "liger: not installed"},
        None,
    )


def test_liger_kernel_agrees_with_the_kit_in_the_interpreter(inputs) -> None:
    module = pytest.importorskip("liger_kernel.ops.attn_res")
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs a GPU or the Triton interpreter")
    entry, _ = public_routing.check(public_routing.bind_liger(module), *inputs)
    assert entry["status"] == "ok"
    assert max(entry["diff"].values()) < 1e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["fla", "liger"])
@pytest.mark.parametrize("d, S", [(192, 2), (1024, 9), (4096, 33)])
def test_the_public_kernels_agree_with_the_kit_cuda(name: str, d: int, S: int) -> None:
    module = pytest.importorskip(public_routing.PUBLIC[name][0])
    torch.manual_seed(d + S)
    sources, query, gain = public_routing.make(256, d, S, mixed=False)
    go = torch.randn(256, d, device="cuda", dtype=torch.bfloat16)
    want = public_routing.outputs(public_routing.bind_kit(1)(sources, query, gain), go)
    entry, _ = public_routing.check(public_routing.BINDERS[name](module), sources, query, gain, go, want)
    assert entry["status"] == "ok", entry


def test_a_missing_package_says_how_to_install_it(monkeypatch) -> None:
    monkeypatch.setitem(public_routing.PUBLIC, "fla", ("no_such_module.attnres", "fla-core", "pip install fla-core"))
    assert public_routing.load_public()["fla"].endswith("; pip install fla-core")


def test_the_floor_counts_each_source_read_once_and_each_gradient_written_once() -> None:
    row = TOKENS * D * 2
    bf16 = [torch.zeros(TOKENS, D, dtype=torch.bfloat16) for _ in range(S)]
    assert public_routing.floor_bytes(bf16) == ((S + 1) * row, (2 * S + 1) * row)
    mixed = [torch.zeros(TOKENS, D)] + bf16[1:]  # an fp32 source makes the mix fp32
    src = (S + 1) * row
    assert public_routing.floor_bytes(mixed) == (src + 2 * row, 2 * row + 2 * src)


def timed(ms: float) -> dict:
    return {"status": "ok", "fwd_ms": ms, "fwdbwd_ms": 3 * ms}


META = {"device": "Card", "versions": {"torch": "2.11", "fla-core": "0.6.0"}, "heads": 8, "copy_bw": 2e12}


def test_the_table_gives_each_time_its_floor_fraction_and_the_kit_against_the_fastest_public_kernel() -> None:
    row = {"d": 1024, "tokens": 16384, "S": 5, "copy_bw": 2e12, "fwd_bytes": 2e8, "fwdbwd_bytes": 6e8}
    rows = [
        row | {"kit H=1": timed(0.2), "kit H=8": timed(0.22), "fla": timed(0.125), "liger": timed(0.15)},
        row | {"S": 9, "kit H=1": timed(0.4), "kit H=8": timed(0.4), "fla": {"status": "refused",
               "diff": {"out": 0.5}}, "liger": {"status": "missing", "note": "liger: not installed; pip install x"}},
    ]  # fmt: skip
    text = public_routing.table(META, rows)
    assert "One Card; torch 2.11, fla-core 0.6.0; copy bandwidth 2.000 TB/s" in text
    # floor 2e8 B / 2e12 B/s = 0.1 ms: the kit at 0.2 ms is 0.50 of it, 1.60x fla's 0.125 ms, its H = 8 1.10x its H = 1
    forward, both = text.split("Forward + backward")
    assert "| 5 | 0.100 | 0.200 (0.50) | 0.125 (0.80) | 0.150 (0.67) | 1.60 | 0.220 (0.45) | 1.10 |" in forward
    assert "| 5 | 0.300 | 0.600 (0.50) | 0.375 (0.80) | 0.450 (0.67) | 1.60 | 0.660 (0.45) | 1.10 |" in both
    assert "| 1024 | 16,384 | 9 | 0.100 | 0.400 (0.25) | refused | - | - | 0.400 (0.25) | 1.00 |" in forward
    assert "- fla at d 1024, S 9: refused, differences out 5.0e-01 (tolerance 0.02)" in both
    assert text.count("- liger: not installed; pip install x") == 1
    header = "| S | floor ms | kit H = 1 | fla | liger | kit / fastest public | kit H = 8 | H = 8 / H = 1 |"
    assert forward.count(header) == both.count(header) == 1


def test_rows_are_kept_only_from_the_same_card_versions_and_heads(tmp_path: Path) -> None:
    path = tmp_path / "rows.json"
    assert public_routing.kept_rows(path, META) == []
    path.write_text(json.dumps({"meta": META, "rows": [{"d": 192}]}))
    assert public_routing.kept_rows(path, META | {"copy_bw": 3e12}) == [{"d": 192}]
    with pytest.raises(ValueError, match="another card, versions or heads; choose another --out"):
        public_routing.kept_rows(path, META | {"heads": 4})


def test_shapes_and_source_counts_are_parsed_or_refused_with_an_example() -> None:
    assert public_routing.parse_shapes("192:65536,4096:8192") == [(192, 65536), (4096, 8192)]
    assert public_routing.parse_sources("2,49") == [2, 49]
    for bad in ("192", "192:x", "192:0", "1:2:3"):
        with pytest.raises(ValueError, match="give D:TOKENS pairs, e.g. 192:65536"):
            public_routing.parse_shapes(bad)
    for bad in ("", "2,a", "0"):
        with pytest.raises(ValueError, match="give source counts of at least 1"):
            public_routing.parse_sources(bad)


@pytest.mark.parametrize(
    "args, error",
    [
        (["--heads", "5"], "heads=5 must divide d_model=192; use one of"),
        (["--heads", "1"], "--heads 1: H = 1 is timed anyway"),
        (["--sources", "2,x"], "--sources '2,x': give source counts of at least 1"),
    ],
)
def test_the_command_refuses_bad_arguments_with_the_fix(monkeypatch, capsys, args: list[str], error: str) -> None:
    monkeypatch.setattr(sys, "argv", ["public_routing.py", *args])
    with pytest.raises(SystemExit) as exit_:
        public_routing.main()
    assert exit_.value.code == 2 and f"public_routing.py: error: {error}" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_the_command_refuses_a_machine_without_a_gpu(monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["public_routing.py", "--sources", "2"])
    with pytest.raises(SystemExit) as exit_:
        public_routing.main()
    assert exit_.value.code == 2 and "error: needs a CUDA GPU; this machine has none" in capsys.readouterr().err


def test_a_row_holds_every_kernel_with_its_times_or_why_not(monkeypatch) -> None:
    monkeypatch.setattr(public_routing, "make", functools.partial(public_routing.make, device="cpu"))
    monkeypatch.setattr(public_routing, "kernel_times", lambda fn: fn() or {"a": 0.25, "b": 0.5})  # device time
    monkeypatch.setattr(public_routing, "do_bench", lambda fn, return_mode: fn() or 2.0)
    public = {"fla": "fla: not installed", "liger": bind_reference(1)}
    row = public_routing.bench_shape(TOKENS, D, S, 4, public, bw=1e12)
    row_bytes = TOKENS * D * 2
    assert (row["fwd_bytes"], row["fwdbwd_bytes"]) == ((S + 1) * row_bytes, (S + 1 + 2 * S + 1) * row_bytes)
    times = {"fwd_ms": 0.75, "fwd_wall_ms": 2.0, "fwdbwd_ms": 0.75, "fwdbwd_wall_ms": 2.0}
    assert row["kit H=1"] == row["kit H=4"] == {"status": "ok"} | times
    assert row["fla"] == {"status": "missing", "note": "fla: not installed"}
    assert row["liger"]["status"] == "ok" and row["liger"].items() >= times.items()
    assert "| 64 | 16 | 3 |" in public_routing.table(META | {"heads": 4}, [row])
