"""Benchmark the depth-routing op alone (forward, forward+backward) against the card's copy bandwidth.

The floor of a memory-bound op is (bytes it must move) / (measured device-to-device copy bandwidth):
forward reads every source once and writes the mix; backward reads the upstream gradient and every
source once and writes one gradient per source. The fraction printed is floor / measured. `bwd ms` is
the backward launcher alone (its two kernels and host work); `f+b ms` goes through autograd, whose host work (about
1 ms a call on an H200's host) bounds it at small S.

    python benchmarks/routing.py [--tokens 16384] [--out results.json]
    python benchmarks/routing.py --apply-rows 32 --elems 8,16,32   # device time per kernel and launch shape
    python benchmarks/routing.py --merge-norm   # a merged read and its pre-norm, with the fused backward and without
    python benchmarks/routing.py --compare old/triton_route.py   # the installed kernels against a one-file version
    python benchmarks/routing.py --merge-rows 8,16,32   # the merged read's backward kernel per rows a program
"""

import argparse
import functools
import importlib.util
import itertools
import json

import torch
import triton
from mhar_lightning.kernels import depth_route, merge_norm, reference, route_launch, triton_merge
from triton.testing import do_bench


def copy_bandwidth(nbytes: int = 2**31) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    x = torch.randn(nbytes // 4, device="cuda")
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median")
    return 2 * nbytes / (ms * 1e-3)


def make(tokens: int, d: int, S: int, mixed: bool, device: str = "cuda"):
    """Random sources: all bf16, or (mixed) an fp32 embedding first, as under bf16 autocast."""
    dtypes = [torch.float32 if mixed and n == 0 else torch.bfloat16 for n in range(S)]
    sources = [torch.randn(tokens, d, device=device).to(dt).requires_grad_() for dt in dtypes]
    query = (0.1 * torch.randn(d, device=device)).requires_grad_()
    gain = (1 + 0.1 * torch.randn(d, device=device)).requires_grad_()
    return sources, query, gain


def floor_bytes(sources) -> tuple[int, int]:
    """Bytes a route over `sources` must move (the module's floor): forward, and backward."""
    src_bytes = sum(v.numel() * v.element_size() for v in sources)
    out_bytes = sources[0].numel() * torch.finfo(route_launch.out_dtype(sources)).bits // 8
    return src_bytes + out_bytes, out_bytes + 2 * src_bytes


def bench(tokens: int, d: int, S: int, heads: int, mixed: bool, bw: float, compiled_ref) -> dict:
    sources, query, gain = make(tokens, d, S, mixed)
    fwd_bytes, bwd_bytes = floor_bytes(sources)
    go = torch.randn(tokens, d, device="cuda", dtype=route_launch.out_dtype(sources))
    u = (query * gain).detach()[None]
    leaves = [*sources, query, gain]

    def fwd_bwd(fn):
        return lambda: torch.autograd.grad(fn(sources, query, gain, heads), leaves, go)

    row = {"tokens": tokens, "d": d, "S": S, "heads": heads, "mixed": mixed}
    row["fwd_ms"] = do_bench(lambda: route_launch.route_forward(sources, u, heads, 1e-6), return_mode="median")
    _, lse, rms = route_launch.route_forward(sources, u, heads, 1e-6)
    row["bwd_ms"] = do_bench(
        lambda: route_launch.route_backward([go], None, lse, rms, sources, u, heads), return_mode="median"
    )
    row["fwdbwd_ms"] = do_bench(fwd_bwd(lambda *a: depth_route(*a, backend="triton")), return_mode="median")
    row["ref_eager_fwdbwd_ms"] = do_bench(fwd_bwd(reference.depth_route), return_mode="median")
    if compiled_ref is not None:
        row["ref_compiled_fwdbwd_ms"] = do_bench(fwd_bwd(compiled_ref), return_mode="median")
    row["fwd_bytes"], row["bwd_bytes"], row["fwdbwd_bytes"] = fwd_bytes, bwd_bytes, fwd_bytes + bwd_bytes
    for part in ("fwd", "bwd", "fwdbwd"):
        row[f"{part}_floor_ms"] = row[f"{part}_bytes"] / bw * 1e3
        row[f"{part}_frac"] = row[f"{part}_floor_ms"] / row[f"{part}_ms"]
    return row


def kernel_times(fn, reps: int = 20) -> dict[str, float]:
    """Device time per call of each kernel `fn` launches, in ms (torch profiler, so host time is excluded)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return {e.key: e.device_time_total / reps / 1e3 for e in prof.key_averages() if e.device_time_total > 0}


MODEL_SHAPES = (  # (label, tokens, d, sources, queries): routing calls of the throughput presets, all-bf16 sources;
    # with two queries the second reads one source fewer, as in a transformer block's shared call
    ("350m block", 16384, 1024, 5, 2),
    ("350m block", 16384, 1024, 9, 2),
    ("350m full", 16384, 1024, 25, 2),
    ("350m full", 16384, 1024, 49, 2),
    ("1b block", 8192, 2048, 5, 2),
    ("1b block", 8192, 2048, 9, 2),
    ("1b full", 8192, 2048, 17, 2),
    ("1b final read", 8192, 2048, 9, 1),
)


def kernel_floors(tokens: int, d: int, S: int, queries: int, bw: float) -> dict[str, float]:
    """Byte floor of each kernel in ms (bf16 rows): what it must read and write once."""
    row = tokens * d * 2
    moved = {
        "_forward_kernel": S + queries,
        "_backward_stats_kernel": S + queries,
        "_backward_apply_kernel": 2 * S + queries,
    }
    return {k: n * row / bw * 1e3 for k, n in moved.items()}


def sweep_kernel_shapes(apply_rows: str, elems: str, bw: float) -> None:
    """Device time of each kernel, and its fraction of the byte floor, per `route_launch.APPLY_ROWS` and per
    row-tile elements per thread (`route_launch.ROW_ELEMS_PER_THREAD`, which then alone sets the warps of every
    kernel: no minimum, no one-warp tile), at MODEL_SHAPES."""
    defaults = route_launch.APPLY_ROWS, route_launch.ROW_ELEMS_PER_THREAD, dict(route_launch.MIN_WARPS)
    one_warp = dict(route_launch.ONE_WARP_TILE)
    route_launch.MIN_WARPS.update(forward=1, stats=1, apply=1)
    route_launch.ONE_WARP_TILE.update(forward=0, stats=0, apply=0)
    for label, tokens, d, S, queries in MODEL_SHAPES:
        sources = [torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16) for _ in range(S)]
        u = 0.1 * torch.randn(queries, d, device="cuda")
        go = [torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16) for _ in range(queries)]
        counts = (S, S - 1)[:queries]
        _, lse, rms = route_launch.route_forward(sources, u, 8, 1e-6, counts)
        floors = kernel_floors(tokens, d, S, queries, bw)
        for rows, e in itertools.product(map(int, apply_rows.split(",")), map(int, elems.split(","))):
            route_launch.APPLY_ROWS = rows
            route_launch.ROW_ELEMS_PER_THREAD = e
            times = kernel_times(lambda: route_launch.route_forward(sources, u, 8, 1e-6, counts))
            times |= kernel_times(lambda: route_launch.route_backward(go, None, lse, rms, sources, u, 8, counts))
            kernels = "  ".join(f"{k} {v:.3f} ({floors[k] / v:.2f})" for k, v in times.items() if k in floors)
            print(f"{label} (d={d} S={S} Q={queries}) apply rows {rows} elems/thread {e}: {kernels}", flush=True)
    route_launch.APPLY_ROWS, route_launch.ROW_ELEMS_PER_THREAD = defaults[:2]
    route_launch.MIN_WARPS.update(defaults[2])
    route_launch.ONE_WARP_TILE.update(one_warp)


def load_kernels(path: str):
    """Another version of the launchers (`route_forward`, `route_backward`) and kernels in one file, such as the
    `kernels/triton_route.py` of versions before the kernels were split into modules, loaded from `path` as a module
    of its own, so its kernels compile apart."""
    spec = importlib.util.spec_from_file_location(f"kernels_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compare_kernels(paths: list[str], bw: float) -> None:
    """Device time of each kernel of the installed `route_launch` and of the versions at `paths`, at MODEL_SHAPES and
    in one process (an A/B that neither the host nor another machine can tilt), with the fraction of its byte floor
    and the largest difference of every output and gradient from the installed version's, relative to its maximum."""
    versions = {"installed": route_launch} | {path: load_kernels(path) for path in paths}
    for label, tokens, d, S, queries in MODEL_SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        sources = [torch.randn(tokens, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(S)]
        u = 0.1 * torch.randn(queries, d, device="cuda", generator=gen)
        go = [torch.randn(tokens, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(queries)]
        glse = 0.1 * torch.randn(queries, tokens, 8, device="cuda", generator=gen)
        counts = (S, S - 1)[:queries]
        floors = kernel_floors(tokens, d, S, queries, bw)
        reference_outputs = None
        for name, kernels in versions.items():
            out, lse, rms = kernels.route_forward(sources, u, 8, 1e-6, counts)
            grads, du = kernels.route_backward(go, glse, lse, rms, sources, u, 8, counts)
            outputs = [*out, lse, *grads, du.sum(0)]
            if reference_outputs is None:
                reference_outputs = outputs
            diff = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                       for a, b in zip(outputs, reference_outputs))  # fmt: skip
            times = kernel_times(lambda: kernels.route_forward(sources, u, 8, 1e-6, counts))
            times |= kernel_times(lambda: kernels.route_backward(go, glse, lse, rms, sources, u, 8, counts))
            each = "  ".join(f"{k.strip('_')} {v:.4f} ({floors[k] / v:.2f})" for k, v in times.items() if k in floors)
            print(f"{label} S={S} Q={queries} {name}: {each}  largest difference {diff:.1e}", flush=True)
        torch.cuda.empty_cache()


def bench_merge_norm(bw: float) -> None:
    """Device time of a merged read and its pre-norm (bf16 route and source under autocast, H = 8), compiled, with
    the fused backward kernel (at its default warps and at 8 or more) and without, forward and backward, against
    their byte floors: the forward reads the mix and the source and writes the normed row (3 rows), the backward
    reads the upstream gradient, the mix and the source and writes the gradients of the mix and the source (5 rows)."""
    for tokens, d in ((16384, 1024), (8192, 2048)):
        gen = torch.Generator(device="cuda").manual_seed(0)
        mix, source = (torch.randn(tokens, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
        lse = torch.randn(tokens, 8, device="cuda", generator=gen)
        query, gain, weight = (1 + 0.1 * torch.randn(d, device="cuda", generator=gen) for _ in range(3))
        leaves = [x.requires_grad_() for x in (mix, lse, source, query, gain, weight)]
        go = torch.randn(tokens, d, device="cuda", generator=gen, dtype=torch.bfloat16)
        row_ms = tokens * d * 2 / bw * 1e3
        for label, backend, warps in (
            ("fused backward", "triton", 4),
            ("fused backward, at least 8 warps", "triton", 8),
            ("unfused", "reference", 4),
        ):
            triton_merge.MIN_WARPS = warps  # read at each launch
            fn = torch.compile(functools.partial(merge_norm, heads=8, backend=backend), dynamic=False)

            def forward():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    return fn(mix, lse, source, query, gain, weight=weight)

            fwd = sum(kernel_times(lambda: forward().detach()).values())
            both = sum(kernel_times(lambda: torch.autograd.grad(forward(), leaves, go)).values())
            print(
                f"merge + norm, {tokens} x {d}, {label}: forward {fwd:.3f} ms ({3 * row_ms / fwd:.2f} of floor), "
                f"backward {both - fwd:.3f} ms ({5 * row_ms / (both - fwd):.2f})",
                flush=True,
            )
    triton_merge.MIN_WARPS = 4


def sweep_merge_rows(rows: str, bw: float) -> None:
    """Device time of the merged read's fused backward kernel per `triton_merge.BACKWARD_ROWS` (rows a program), at
    350m's and 1b's shapes (bf16 rows, H = 8), against its byte floor (5 rows: see `bench_merge_norm`)."""
    default = triton_merge.BACKWARD_ROWS
    for tokens, d in ((16384, 1024), (8192, 2048)):
        gen = torch.Generator(device="cuda").manual_seed(0)
        mix, source, go = (torch.randn(tokens, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(3))
        lse = torch.randn(tokens, 8, device="cuda", generator=gen)
        u, weight = (1 + 0.1 * torch.randn(d, device="cuda", generator=gen) for _ in range(2))
        _, stats = triton_merge.merge_norm_forward(mix, lse, source, u, weight, 8, 1e-6, 1e-6, torch.bfloat16)
        floor = 5 * tokens * d * 2 / bw * 1e3
        for n in map(int, rows.split(",")):
            triton_merge.BACKWARD_ROWS = n  # read at each launch
            times = kernel_times(lambda: triton_merge.merge_norm_backward(go, mix, source, u, weight, stats, 8))
            ms = sum(times.values())
            print(f"merge backward, {tokens} x {d}, {n} rows a program: {ms:.4f} ms ({floor / ms:.2f})", flush=True)
    triton_merge.BACKWARD_ROWS = default


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8 * 2048)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument(
        "--compile-ref-s", type=int, default=9, help="time the compiled reference too at this S (mixed)"
    )
    parser.add_argument("--sources", default="2,5,9,25,49", help="numbers of sources S to time")
    parser.add_argument("--apply-rows", default=None, help="only time each kernel per launch shape, e.g. 16,32,64")
    parser.add_argument("--elems", default="8,16,32", help="row-tile elements per thread to sweep with --apply-rows")
    parser.add_argument("--merge-norm", action="store_true", help="only time a merged read and its pre-norm")
    parser.add_argument("--compare", default=None, help="only time the kernels against these one-file versions")
    parser.add_argument("--merge-rows", default=None, help="only time the merge backward per rows a program, e.g. 8,16")
    args = parser.parse_args()
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"copy bandwidth (read+write): {bw / 1e12:.3f} TB/s")
    if args.apply_rows:
        return sweep_kernel_shapes(args.apply_rows, args.elems, bw)
    if args.merge_norm:
        return bench_merge_norm(bw)
    if args.compare:
        return compare_kernels(args.compare.split(","), bw)
    if args.merge_rows:
        return sweep_merge_rows(args.merge_rows, bw)
    compiled_ref = torch.compile(reference.depth_route, dynamic=False)
    rows = []
    for d in (1024, 2048):
        for S in map(int, args.sources.split(",")):
            for mixed in (False, True):
                ref = compiled_ref if S == args.compile_ref_s and mixed else None
                rows.append(bench(args.tokens, d, S, 8, mixed, bw, ref))
                torch.cuda.empty_cache()
    print(
        f"{'d':>5} {'S':>3} {'src':>5} | {'fwd ms':>7} {'floor':>7} {'frac':>5} | "
        f"{'bwd ms':>7} {'floor':>7} {'frac':>5} | {'f+b ms':>7} {'floor':>7} {'frac':>5} | "
        f"{'ref eager':>9} {'ref comp':>8}"
    )
    for r in rows:
        comp = f"{r['ref_compiled_fwdbwd_ms']:8.3f}" if "ref_compiled_fwdbwd_ms" in r else f"{'-':>8}"
        print(
            f"{r['d']:5d} {r['S']:3d} {'mixed' if r['mixed'] else 'bf16':>5} | "
            f"{r['fwd_ms']:7.3f} {r['fwd_floor_ms']:7.3f} "
            f"{r['fwd_frac']:5.2f} | {r['bwd_ms']:7.3f} {r['bwd_floor_ms']:7.3f} {r['bwd_frac']:5.2f} | "
            f"{r['fwdbwd_ms']:7.3f} {r['fwdbwd_floor_ms']:7.3f} {r['fwdbwd_frac']:5.2f} | "
            f"{r['ref_eager_fwdbwd_ms']:9.3f} {comp}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"copy_bw": bw, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
