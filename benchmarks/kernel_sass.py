"""Static resources of the routing kernels, on any machine (no GPU needed): registers, spilled bytes and the SASS
instructions of each kernel's loops, compiled for a CUDA architecture with the launch settings the kit uses.

The per-row kernels are bound by instructions and latency, not bytes (docs/kernels.md), so the instructions a loop
issues per pass (a source in the forward and statistics kernels, a row of one source in the gradient kernel) and
the spills are what a change must reduce before it is worth timing on a GPU. Sources are bf16 and 16-byte aligned,
the gradient of the log-sum-exps is used, as in training.

    python benchmarks/kernel_sass.py [--d 1024 2048] [--heads 8] [--queries 1 2] [--kernels forward stats apply] \\
        [--arch 90] [--out rows.json]
"""

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from mhar_lightning.kernels import route_launch
from mhar_lightning.kernels.backward_kernels import _backward_apply_kernel, _backward_stats_kernel
from mhar_lightning.kernels.forward_kernel import _forward_kernel
from mhar_lightning.kernels.rows import BF16
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

COUNTED = ("LDL", "STL", "SHFL", "BAR", "LDG", "STG", "FFMA", "FMUL", "FADD", "MUFU")
"""Opcodes counted in each loop: spills (LDL, STL), shuffles, barriers, global memory, floating point, special."""

_POINTERS = {"table": "*i64", "u_ptr": "*fp32", "lse_ptr": "*fp32", "rms_ptr": "*fp32", "glse_ptr": "*fp32"}
_POINTERS |= {name: "*fp32" for name in ("p_ptr", "q_ptr", "c_ptr", "du_ptr")}
_POINTERS |= {name: "*bf16" for name in ("out0_ptr", "out1_ptr", "gout_ptr")}
_FLOATS, _WIDE = {"eps"}, {"G1R"}


def scalars(d: int, heads: int, sources: int, tokens: int, seq_len: int) -> dict[str, int]:
    """The integer arguments of a routing call over `sources` [tokens / seq_len, seq_len, d] rows. The second query's
    gradient is a separate allocation: the allocator aligns blocks to 512 bytes, so it starts some rows (here 17) and
    a multiple of 256 elements from the first."""
    return {"S": sources, "S0": sources, "S1": sources - 1, "M": tokens, "M1": seq_len, "D": d, "H": heads,
            "DH": d // heads, "G1R": 17, "G1E": 256}  # fmt: skip


def specialise(kernel, constexprs: dict, values: dict[str, int]) -> tuple[dict[str, str], dict, dict]:
    """Signature, compile-time arguments and attributes of `kernel` as Triton specialises a launch with `values`:
    pointers (16-byte aligned) and integers divisible by 16 are marked so, an integer 1 becomes a constant."""
    signature, constexprs, attrs = {}, dict(constexprs), {}
    for index, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif values.get(name) == 1:
            signature[name], constexprs[name] = "constexpr", 1
        else:
            kind = _POINTERS.get(name) or ("fp32" if name in _FLOATS else "i64" if name in _WIDE else "i32")
            signature[name] = kind
            if kind.startswith("*") or (name in values and values[name] % 16 == 0):
                attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def launch_settings(kernel: str, d: int, heads: int, queries: int) -> tuple[object, dict, int]:
    """The kernel, its compile-time arguments and warps as `route_launch` launches it on a GPU for bf16 sources."""
    bh, bdh, warps = route_launch.launch_shape(
        d, heads, route_launch.ROW_ELEMS_PER_THREAD, route_launch.MIN_WARPS[kernel], False,
        route_launch.ONE_WARP_TILE[kernel],
    )  # fmt: skip
    common = {"BH": bh, "BDH": bdh, "K0": BF16.value, "KR": BF16.value, "ALIGN": (d // heads) % 8 == 0, "Q": queries}
    if kernel == "forward":
        return _forward_kernel, common | {"LAZY": route_launch.lazy_rescale(warps)}, warps
    if kernel == "stats":
        return _backward_stats_kernel, common | {"HAS_GLSE": True, "SC": route_launch.STATS_SOURCES}, warps
    return _backward_apply_kernel, {"BR": route_launch.APPLY_ROWS} | common, warps


def tool(name: str) -> str:
    """A CUDA binary tool shipped with Triton's NVIDIA backend (cuobjdump)."""
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        raise SystemExit(f"{path} not found: install a Triton wheel with its NVIDIA backend")
    return str(path)


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction) of each line of a `cuobjdump -sass` listing, predicate included."""
    return [(int(a, 16), text.strip()) for a, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;/]+);", sass)]


def opcode(text: str) -> str:
    """The opcode of an instruction without its predicate and modifiers: `@!P0 LDG.E.128 R4, ...` -> LDG."""
    words = text.split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]


def loops(listing: list[tuple[int, str]]) -> list[dict]:
    """Every backward branch's loop: its first and last address, instructions, the instructions outside the bodies
    that a predicated forward branch inside the loop can skip ("main": a pass that takes no such branch), and counts
    of `COUNTED` opcodes, longest first."""
    found = []
    for address, text in listing:
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address:
            start = int(target.group(1), 16)
            body = [(a, t) for a, t in listing if start <= a <= address]
            skippable = set()
            for a, t in body:
                jump = re.search(r"^@!?U?P\d+ BRA.*?0x([0-9a-f]+)", t)
                if jump and a < int(jump.group(1), 16) <= address:
                    skippable |= {b for b, _ in body if a < b < int(jump.group(1), 16)}
            ops = collections.Counter(opcode(t) for _, t in body)
            loop = {"start": start, "end": address, "instructions": ops.total(), "main": len(body) - len(skippable)}
            found.append(loop | {k: ops[k] for k in COUNTED})
    return sorted(found, key=lambda loop: -loop["instructions"])


def analyse(kernel: str, d: int, heads: int, queries: int, arch: int, workdir: Path, sources: int = 5) -> dict:
    """Compile one kernel for `arch` as a call over `sources` sources of 16,384 tokens (sequences of 2,048) launches
    it, and read its registers, stack (spills) and loops."""
    fn, constexprs, warps = launch_settings(kernel, d, heads, queries)
    signature, constexprs, attrs = specialise(fn, constexprs, scalars(d, heads, sources, 16384, 2048))
    source = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    cubin = workdir / f"{kernel}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    usage = subprocess.run([tool("cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True, check=True)
    sass = subprocess.run([tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True, check=True)
    listing = instructions(sass.stdout)
    return {
        "kernel": kernel, "d": d, "heads": heads, "queries": queries, "arch": arch, "warps": warps,
        "registers": int(re.search(r"REG:(\d+)", usage.stdout).group(1)),
        "stack_bytes": int(re.search(r"STACK:(\d+)", usage.stdout).group(1)),
        "instructions": len(listing), "loops": loops(listing), "triton": triton.__version__,
    }  # fmt: skip


def table(rows: list[dict]) -> str:
    """A Markdown table: one row per compiled kernel, its longest loop's instructions a pass (all, and on its main
    path) and their kinds."""
    lines = [
        "| kernel | d | queries | warps | registers | spilled bytes | loop instructions | main path | "
        + " | ".join(COUNTED)
        + " |",
        "| --- |" + " ---: |" * (7 + len(COUNTED)),
    ]
    for r in rows:
        loop = r["loops"][0] if r["loops"] else dict.fromkeys(("instructions", "main", *COUNTED), 0)
        cells = [r["d"], r["queries"], r["warps"], r["registers"], r["stack_bytes"], loop["instructions"], loop["main"]]
        lines.append(f"| {r['kernel']} | " + " | ".join(str(c) for c in cells + [loop[k] for k in COUNTED]) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, nargs="+", default=[1024, 2048], help="model widths")
    parser.add_argument("--heads", type=int, default=8, help="routing heads")
    parser.add_argument("--queries", type=int, nargs="+", default=[1, 2], choices=(1, 2), help="queries per call")
    parser.add_argument(
        "--kernels", nargs="+", default=["forward", "stats", "apply"], choices=("forward", "stats", "apply")
    )
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10 (90: Hopper)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled")
    if any(d % args.heads for d in args.d):
        parser.error(f"--heads {args.heads} must divide every --d {args.d}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for d in args.d:
            for kernel in args.kernels:
                for queries in args.queries:
                    rows.append(analyse(kernel, d, args.heads, queries, args.arch, Path(tmp)))
    print(f"triton {triton.__version__}, sm_{args.arch}, bf16 sources, H = {args.heads}", file=sys.stderr)
    print(table(rows))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
