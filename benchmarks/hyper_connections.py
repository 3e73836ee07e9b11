"""Benchmark hyper-connections' fused sublayer boundary (`mhar::hc_boundary`) against its PyTorch reference compiled
by Inductor, and against the card's copy bandwidth.

One boundary as a block runs it under bf16 autocast: fp32 streams [T, n, d], a bf16 sublayer output, the dynamic
projection in bf16. The forward's floor moves the n streams in and out, y in and the read x out; the backward's
reads the new streams twice (once for <grad x, H'>), the old streams, y and the upstream gradients, and writes the
streams' and y's gradients. Each time is the median of triton's `do_bench`; "frac" is floor / time.

    python benchmarks/hyper_connections.py [--tokens 16384] [--d 1024 2048] [--rate 4] [--out rows.json]
    python benchmarks/hyper_connections.py --sweep        # the fused op's launch settings, forward and backward
"""

import argparse
import itertools
import json

import torch
from routing import copy_bandwidth
from triton.testing import do_bench

from mhar_lightning.kernels import hyper_kernels
from mhar_lightning.kernels.hyper_connections import boundary_reference, hc_boundary


def inputs(tokens: int, d: int, n: int, write: bool) -> list[torch.Tensor | None]:
    r = lambda *shape: torch.randn(*shape, device="cuda")  # noqa: E731
    eye = torch.eye(n, device="cuda")
    written = [r(tokens, d).bfloat16(), eye + 0.1 * r(tokens, n, n), 1 + 0.1 * r(tokens, n)] if write else [None] * 3
    return [r(tokens, n, d), *written, r(d, n + 2) / d**0.5, eye[0] + 0.1 * r(n), eye + 0.1 * r(n, n),
            1 + 0.1 * r(n), torch.tensor([0.1, 0.1], device="cuda")]  # fmt: skip


def bench(tokens: int, d: int, n: int, write: bool, bandwidth: float) -> dict:
    args = inputs(tokens, d, n, write)
    leaves = [t.requires_grad_() for t in args if t is not None]
    compiled = torch.compile(boundary_reference)
    row = {"tokens": tokens, "d": d, "rate": n, "write": write}
    stream, half = tokens * d * 4, tokens * d * 2
    fwd_bytes = n * stream * (2 if write else 1) + (half if write else 0) + stream
    bwd_bytes = (3 * n + 2 * n * write + 2) * stream + (2 * half if write else 0)
    for name, fn in (("fused", hc_boundary), ("inductor", compiled)):

        def outputs(fn=fn):
            with torch.autocast("cuda", torch.bfloat16):
                return fn(*args, 1e-5)[0 if write else 1 :]  # without a write the streams pass through

        grads = [torch.randn_like(o) for o in outputs()]

        def forward(fn=fn):
            with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
                fn(*args, 1e-5)

        row[f"{name}_fwd_ms"] = do_bench(forward, return_mode="median")
        row[f"{name}_fwd_bwd_ms"] = do_bench(
            lambda: torch.autograd.grad(outputs(), leaves, grads), return_mode="median"
        )
    row["fwd_floor_ms"] = fwd_bytes / bandwidth * 1e3
    row["fwd_bwd_floor_ms"] = (fwd_bytes + bwd_bytes) / bandwidth * 1e3
    return row


def sweep(tokens: int, d: int, n: int) -> None:
    """Forward and forward + backward time of the fused op per (rows a program, columns a pass, warps, stages)."""
    args = inputs(tokens, d, n, True)
    leaves = [t.requires_grad_() for t in args if t is not None]
    with torch.autocast("cuda", torch.bfloat16):
        grads = [torch.randn_like(o) for o in hc_boundary(*args, 1e-5)]
    for rows, columns, warps, stages in itertools.product((16, 32, 64), (64, 128, 256), (4, 8), (1, 2, 3)):
        hyper_kernels.ROWS, hyper_kernels.COLUMNS, hyper_kernels.WARPS, hyper_kernels.STAGES = (
            rows,
            columns,
            warps,
            stages,
        )

        def forward():
            with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
                hc_boundary(*args, 1e-5)

        def forward_backward():
            with torch.autocast("cuda", torch.bfloat16):
                outputs = hc_boundary(*args, 1e-5)
            torch.autograd.grad(outputs, leaves, grads)

        try:
            f, fb = do_bench(forward, return_mode="median"), do_bench(forward_backward, return_mode="median")
            print(f"rows {rows} columns {columns} warps {warps} stages {stages}: fwd {f:.3f} ms, f+b {fb:.3f} ms",
                  flush=True)  # fmt: skip
        except Exception as error:  # a setting the compiler or the card refuses (shared memory, registers)
            print(f"rows {rows} columns {columns} warps {warps} stages {stages}: {type(error).__name__}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--d", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--rate", type=int, default=4)
    parser.add_argument("--out", default=None)
    parser.add_argument("--sweep", action="store_true", help="time the fused op's launch settings instead")
    args = parser.parse_args()
    if args.sweep:
        for d in args.d:
            sweep(args.tokens, d, args.rate)
        return
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s")
    print(
        "| d | write | fused fwd ms | inductor fwd ms | floor | frac | fused f+b ms | inductor f+b ms | floor | frac |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for d in args.d:
        for write in (True, False):
            row = bench(args.tokens, d, args.rate, write, bandwidth)
            rows.append(row)
            print(f"| {d} | {'yes' if write else 'no'} | {row['fused_fwd_ms']:.3f} | {row['inductor_fwd_ms']:.3f} | "
                  f"{row['fwd_floor_ms']:.3f} | {row['fwd_floor_ms'] / row['fused_fwd_ms']:.2f} | "
                  f"{row['fused_fwd_bwd_ms']:.3f} | {row['inductor_fwd_bwd_ms']:.3f} | {row['fwd_bwd_floor_ms']:.3f} | "
                  f"{row['fwd_bwd_floor_ms'] / row['fused_fwd_bwd_ms']:.2f} |", flush=True)  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"bandwidth": bandwidth, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
