"""Benchmark the kit's routing op beside the public fused AttnRes kernels, against the card's copy bandwidth.

The public kernels compute the kit's H = 1 route (RMS-normalised keys, one pseudo-query, softmax over depth):
fla-core's `fla.ops.attnres.fused_attnres` and liger-kernel's `LigerAttnResFunction` (which takes the sources
stacked into one tensor: the stack is made once, outside the timing). Both are optional: a package that is not
installed is a column of '-'. At every shape each public kernel's output and gradients are first checked against the
kit's H = 1 route on the same inputs (bf16 sources, fp32 query and gain); one that disagrees is not timed. The kit is
also timed at H heads (default 8), against its own H = 1.

Times are device time a call (the kernels' time in the CUDA profiler, host excluded), forward under no_grad and
forward + backward through autograd; the JSON also holds wall times (`triton.testing.do_bench`, host included). The
floor is `routing.py`'s: the bytes a call must move over the measured device-to-device copy bandwidth.
Rows are written to --out after each shape, and shapes already there are kept: rerun the command to continue.

    python benchmarks/public_routing.py [--out public_routing.json] [--table public_routing.md]
    python benchmarks/public_routing.py --shapes 192:65536 --sources 2,9,49
"""

import argparse
import importlib
import importlib.metadata
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from mhar_lightning.kernels import KEY_NORM_EPS, depth_route, route_launch
from mhar_lightning.kernels.query import check_heads
from routing import copy_bandwidth, floor_bytes, kernel_times, make
from torch import Tensor
from triton.testing import do_bench

# Largest difference allowed, relative to the kit's largest magnitude: two bf16 results each rounded once from fp32
# may differ by one bf16 step, up to 2**-7 (0.0078) of a value.
TOLERANCE = 2e-2
PUBLIC = {  # name: (module, distribution, what to install)
    "fla": ("fla.ops.attnres", "fla-core", "pip install fla-core==0.6.0 einops"),
    "liger": ("liger_kernel.ops.attn_res", "liger-kernel", "pip install liger-kernel==0.8.5"),
}
SHAPES = "192:65536,1024:16384,2048:16384,4096:8192"
PASSES = (("fwd", "Forward"), ("fwdbwd", "Forward + backward"))


@dataclass(frozen=True)
class Bound:
    """One implementation on one shape's inputs: a call that returns the mix, and the leaves its gradient reaches
    (the sources, one by one or stacked, then the query and the gain)."""

    call: Callable[[], Tensor]
    leaves: list[Tensor]


def bind_kit(heads: int) -> Callable[[list[Tensor], Tensor, Tensor], Bound]:
    """The kit's fused op at `heads` heads."""
    return lambda sources, query, gain: Bound(
        lambda: depth_route(sources, query, gain, heads, backend="triton"), [*sources, query, gain]
    )


def bind_fla(module) -> Callable[[list[Tensor], Tensor, Tensor], Bound]:
    """`fused_attnres` with its defaults (Triton backend, the mix recomputed in the backward)."""
    return lambda sources, query, gain: Bound(
        lambda: module.fused_attnres(query, sources, gain, rms_eps=KEY_NORM_EPS), [*sources, query, gain]
    )


def bind_liger(module) -> Callable[[list[Tensor], Tensor, Tensor], Bound]:
    """`LigerAttnResFunction` over the sources stacked into one [S, tokens, d] leaf."""

    def bind(sources: list[Tensor], query: Tensor, gain: Tensor) -> Bound:
        stacked = torch.stack([v.detach() for v in sources]).requires_grad_()
        call = module.LigerAttnResFunction.apply
        return Bound(lambda: call(stacked, query, gain, KEY_NORM_EPS), [stacked, query, gain])

    return bind


BINDERS = {"fla": bind_fla, "liger": bind_liger}


def load_public() -> dict[str, Callable | str]:
    """Each public kernel's binder, or the line that says how to install it."""
    found = {}
    for name, (module, _, install) in PUBLIC.items():
        try:
            found[name] = BINDERS[name](importlib.import_module(module))
        except ImportError as e:
            found[name] = f"{name}: not installed ({e}); {install}"
        except Exception as e:  # an installed package that does not import here (another torch or Triton)
            found[name] = f"{name}: {module} does not import ({type(e).__name__}: {e}); {install}"
    return found


def outputs(bound: Bound, go: Tensor) -> dict[str, Tensor]:
    """The mix and the gradients of the sources (flattened in order), the query and the gain, for upstream `go`."""
    out = bound.call()
    *sources, query, gain = torch.autograd.grad(out, bound.leaves, go)
    return {"out": out.detach(), "sources": torch.cat([g.flatten() for g in sources]), "query": query, "gain": gain}


def differences(got: dict[str, Tensor], want: dict[str, Tensor]) -> dict[str, float]:
    """Largest difference of each of `got` from `want`, relative to the largest magnitude of `want`."""
    return {k: ((got[k].float() - w.float()).abs().max() / w.float().abs().max()).item() for k, w in want.items()}


def timings(bound: Bound, go: Tensor) -> dict[str, float]:
    """Device and wall ms a call, forward alone and forward + backward."""

    def forward() -> None:
        with torch.no_grad():
            bound.call()

    def both() -> None:
        torch.autograd.grad(bound.call(), bound.leaves, go)

    times = {}
    for part, fn in (("fwd", forward), ("fwdbwd", both)):
        times[f"{part}_ms"] = sum(kernel_times(fn).values())
        times[f"{part}_wall_ms"] = do_bench(fn, return_mode="median")
    return times


def check(binder: Callable | str, sources: list[Tensor], query: Tensor, gain: Tensor, go: Tensor,
          want: dict[str, Tensor]) -> tuple[dict, Bound | None]:  # fmt: skip
    """A public kernel's entry of a row, and the kernel bound to the inputs if it may be timed: `missing`, `failed`
    (its error), `refused` (its differences from the kit's H = 1 outputs `want` exceed TOLERANCE) or `ok`."""
    if isinstance(binder, str):
        return {"status": "missing", "note": binder}, None
    try:
        bound = binder(sources, query, gain)
        diff = differences(outputs(bound, go), want)
    except Exception as e:  # an optional kernel that cannot run this shape is a result, not the end of the run
        first = (str(e).strip().splitlines() or [""])[0]
        return {"status": "failed", "note": f"{type(e).__name__}: {first[:200]}"}, None
    if max(diff.values()) > TOLERANCE:
        return {"status": "refused", "diff": diff}, None
    return {"status": "ok", "diff": diff}, bound


def bench_shape(tokens: int, d: int, S: int, heads: int, public: dict, bw: float) -> dict:
    """One row: the kit at H = 1 and at `heads`, and each public kernel, on the same bf16 sources."""
    sources, query, gain = make(tokens, d, S, mixed=False)
    go = torch.randn(tokens, d, device=query.device, dtype=route_launch.out_dtype(sources))
    fwd, bwd = floor_bytes(sources)
    row = {"d": d, "tokens": tokens, "S": S, "copy_bw": bw, "fwd_bytes": fwd, "fwdbwd_bytes": fwd + bwd}
    kit1 = bind_kit(1)(sources, query, gain)
    want = outputs(kit1, go)
    row["kit H=1"] = {"status": "ok"} | timings(kit1, go)
    row[f"kit H={heads}"] = {"status": "ok"} | timings(bind_kit(heads)(sources, query, gain), go)
    for name, binder in public.items():
        entry, bound = check(binder, sources, query, gain, go, want)
        row[name] = entry | (timings(bound, go) if bound else {})
        del bound
        torch.cuda.empty_cache()
    return row


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """`D:TOKENS,...` as [(d, tokens), ...]."""
    try:
        shapes = [tuple(int(x) for x in item.split(":")) for item in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise ValueError(f"--shapes {text!r}: give D:TOKENS pairs, e.g. {SHAPES}")
    return shapes


def parse_sources(text: str) -> list[int]:
    """`2,5,9` as [2, 5, 9]."""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise ValueError(f"--sources {text!r}: give source counts of at least 1, e.g. 2,5,9,17,33,49")
    return counts


def kept_rows(path: Path, meta: dict) -> list[dict]:
    """The rows of an earlier run at `path` (none if it does not exist), if it ran on the same card, versions and
    heads."""
    if not path.exists():
        return []
    earlier = json.loads(path.read_text())
    if earlier["meta"] | {"copy_bw": None} != meta | {"copy_bw": None}:
        raise ValueError(f"{path} holds rows of another card, versions or heads; choose another --out")
    return earlier["rows"]


def cell(entry: dict, part: str, floor_ms: float) -> str:
    """`ms (fraction of the floor)`, or why there is no time."""
    if entry["status"] != "ok":
        return {"missing": "-"}.get(entry["status"], entry["status"])
    ms = entry[f"{part}_ms"]
    return f"{ms:.3f} ({floor_ms / ms:.2f})"


def table(meta: dict, rows: list[dict]) -> str:
    """The rows as Markdown: per pass, device ms a call with its fraction of the floor, the kit's time over the fastest
    public kernel's (at most 1.00: the kit is as fast) and its H heads over its H = 1; then a line per kernel not
    timed."""
    heads = meta["heads"]
    versions = ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
    lines = [f"One {meta['device']}; {versions}; copy bandwidth {meta['copy_bw'] / 1e12:.3f} TB/s (read + write)."]
    notes = []
    for part, title in PASSES:
        lines += [
            "",
            f"{title}, device ms a call (fraction of the byte floor):",
            "",
            f"| d | tokens | S | floor ms | kit H = 1 | {' | '.join(PUBLIC)} | kit / fastest public | kit H = {heads} "
            f"| H = {heads} / H = 1 |",
            "|" + " ---: |" * (8 + len(PUBLIC)),
        ]
        for r in rows:
            floor_ms = r[f"{part}_bytes"] / r["copy_bw"] * 1e3
            kit1, kith = r["kit H=1"], r[f"kit H={heads}"]
            public = [r[name][f"{part}_ms"] for name in PUBLIC if r[name]["status"] == "ok"]
            ratio = f"{kit1[f'{part}_ms'] / min(public):.2f}" if public else "-"
            cells = [
                f"{r['d']}", f"{r['tokens']:,}", f"{r['S']}", f"{floor_ms:.3f}", cell(kit1, part, floor_ms),
                *(cell(r[name], part, floor_ms) for name in PUBLIC), ratio, cell(kith, part, floor_ms),
                f"{kith[f'{part}_ms'] / kit1[f'{part}_ms']:.2f}",
            ]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    for r in rows:
        for name in PUBLIC:
            e = r[name]
            if e["status"] == "refused":
                diff = ", ".join(f"{k} {v:.1e}" for k, v in e["diff"].items())
                notes.append(f"- {name} at d {r['d']}, S {r['S']}: refused, differences {diff} (tolerance {TOLERANCE})")
            elif e["status"] == "failed":
                notes.append(f"- {name} at d {r['d']}, S {r['S']}: {e['note']}")
            elif e["status"] == "missing" and f"- {e['note']}" not in notes:
                notes.append(f"- {e['note']}")
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def versions() -> dict[str, str]:
    """torch, Triton and each installed public package's version."""
    found = {"torch": torch.__version__, "triton": triton.__version__}
    for _, dist, _ in PUBLIC.values():
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=SHAPES, help="D:TOKENS pairs to time")
    parser.add_argument("--sources", default="2,5,9,17,33,49", help="numbers of sources S to time")
    parser.add_argument("--heads", type=int, default=8, help="the kit's heads, timed beside its H = 1")
    parser.add_argument("--out", default="public_routing.json", help="rows as JSON, kept across runs")
    parser.add_argument("--table", default=None, help="the Markdown table (default: --out with .md)")
    args = parser.parse_args()
    try:
        shapes, counts = parse_shapes(args.shapes), parse_sources(args.sources)
        if args.heads < 2:
            raise ValueError(f"--heads {args.heads}: H = 1 is timed anyway; give the kit's H of 2 or more")
        for d, _ in shapes:
            check_heads(d, args.heads)
    except ValueError as e:
        parser.error(str(e))
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU; this machine has none")
    out = Path(args.out)
    table_path = Path(args.table) if args.table else out.with_suffix(".md")
    torch.manual_seed(0)
    public = load_public()
    bw = copy_bandwidth()
    meta = {"device": torch.cuda.get_device_name(), "versions": versions(), "heads": args.heads, "copy_bw": bw}
    print(f"{meta['device']}  {meta['versions']}  copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    try:
        rows = kept_rows(out, meta)
    except ValueError as e:
        parser.error(str(e))
    done = {(r["d"], r["tokens"], r["S"]) for r in rows}
    for d, tokens in shapes:
        for S in counts:
            if (d, tokens, S) in done:
                continue
            rows.append(bench_shape(tokens, d, S, args.heads, public, bw))
            torch.cuda.empty_cache()
            out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
            table_path.write_text(table(meta, rows))
            print(f"d {d} tokens {tokens} S {S}: done", flush=True)
    print(table(meta, rows))


if __name__ == "__main__":
    main()
