"""Training-step throughput and peak memory of each residual strategy, as a ratio to `sum` in the same run.

Every step is forward, backward and a fused AdamW step on one fixed batch in bf16, with each transformer
block compiled on its own with the kit's Inductor options (`compile_blocks`). Two precision protocols:
`autocast` (fp32 weights under bf16 autocast, as `precision: bf16-mixed` trains; the residual stream stays
fp32) and `fsdp-bf16` (FSDP2 on one GPU with bf16 compute weights and fp32 gradient reduction, as the 1b and
8b recipes train; FSDP2's hooks add host time). Tokens/s is the median over the timed steps; peak memory is
`torch.cuda.max_memory_allocated` over them; host ms is the median time Python takes to issue a step (close
to the step time means the GPU waits on the host).

    python benchmarks/throughput.py [--presets 100m,350m,1b] [--precisions autocast,fsdp-bf16] [--out results.json]

`--compiled-autograd` captures each step's backward as one compiled graph (torch's compiled autograd), so the
gradient sums of sources read by several routing calls can fuse and the autograd engine's per-node host work
goes; it applies to every variant of the run, `sum` included.

`--inductor KEY=VALUE` overrides one of those options (`parallel.INDUCTOR_OPTIONS`) or adds another, for the
blocks and the compiled-autograd graphs of every variant; `--inductor combo_kernels=False` is the Inductor default.

Each row's `phase_ms` splits a step into forward, backward and optimizer: the host's time to issue each and the GPU
time between its boundaries. A phase whose GPU time is close to its host time (or the step's start) is where the
GPU waited on the host.

Tokens/s times each step on its own (a synchronise between steps, as a training loop that reads its loss every
step does), so each step starts on an idle GPU and its first blocks may wait on the host. `tok_s_pipelined` times the
same number of steps back to back with one synchronise at the end, where a host that keeps up never leaves the GPU
idle: its ratio then follows the kernels' (back to back is not always faster: benchmarks/RESULTS.md, v26).

Each row's `host` records the CPU model and clock, usable cores, load and the process's threads before the timed
steps: the same code has issued a step in 56 ms on one machine and 97 ms on another (benchmarks/NOTES.md, "Next").

`--repeats R` runs the whole list R times (each model rebuilt; compiles then come from the cache) and reports
each ratio as the median over the repeats of the variant against `sum` of the same repeat, with its range:
between runs the `sum` step alone moves by about 1.5 % (benchmarks/RESULTS.md, v10).

Each run has a fresh Python process, as a training job does: in one process, 350m delta-MHAR issued its steps in
121 ms after full MHAR had run, and in 54 ms first, with every phase (the optimizer's too) about 2.3x slower
(benchmarks/RESULTS.md, v22). `--one-process` runs them all in this one, as before.
"""

import argparse
import ast
import gc
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gpu_idle  # beside this script
import torch
import torch.distributed as dist
import torch.nn.functional as F
import triton
from torch._dynamo.utils import counters
from torch.autograd import DeviceType
from torch.distributed.device_mesh import init_device_mesh

from mhar_lightning.config import ModelConfig
from mhar_lightning.model import Decoder
from mhar_lightning.parallel import INDUCTOR_OPTIONS, apply_fsdp, compile_blocks, compiled_backward, inductor_options
from mhar_lightning.residual import make_residual

SEQ_LEN = 2048
BATCH = {"100m": 16, "350m": 8, "1b": 4}
VARIANTS = {  # in run order: the ones with targets first
    "sum": ("sum", {}),
    "mhar-h8-block8": ("mhar", {"heads": 8, "blocks": 8}),
    "mhar-h8-full": ("mhar", {"heads": 8, "blocks": None}),
    "delta-mhar-h8": ("delta-mhar", {"heads": 8}),
    "attnres-block8": ("attnres", {"blocks": 8}),
}


def allow_recompiles() -> None:
    """Full routing gives every block its own stream length, so each block compiles its own graph."""
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 1024)
    for name in ("accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 1 << 16)


def profile(step, label: str, trace: str | None = None) -> list[tuple[str, int, float]]:
    """Print the GPU time of one step per kernel and its host time per op (top 25 each), to see where a strategy
    spends its overhead (the host table runs under the profiler's own per-op cost: compare strategies, not steps).
    With `trace` (a folder), also write the step's chrome trace there (`<label>.json.gz`, then `<label>-2.json.gz` for a
    repeat) and print where its GPU sat idle (`gpu_idle`).

    Returns every kernel as (name, calls, device ms), longest first; their sum well below the timed step means
    the GPU waited on the host. Only kernels count: the ops that launch them carry the same device time, and so does
    the optimizer's annotation on the GPU timeline ("Optimizer.step#AdamW.step", counted twice before v25).
    """
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        step()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    for sort_by in ("self_device_time_total", "self_cpu_time_total"):
        table = averages.table(sort_by=sort_by, row_limit=25, max_name_column_width=60)
        print(f"--- profile ({sort_by}): {label}\n{table}", flush=True)
    if trace:
        name, repeat = label.replace(" ", "_"), 1
        path = Path(trace) / f"{name}.json.gz"
        while path.exists():  # a repeat of the same run
            repeat += 1
            path = Path(trace) / f"{name}-{repeat}.json.gz"
        prof.export_chrome_trace(str(path))
        print(f"--- GPU idle time: {label} ({path})", flush=True)
        gpu_idle.print_report(gpu_idle.analyse(gpu_idle.load_events(str(path))))
    kernels = [
        (e.key, e.count, e.self_device_time_total * 1e-3)
        for e in averages
        if e.device_type == DeviceType.CUDA and not e.is_user_annotation
    ]
    return sorted(kernels, key=lambda k: -k[2])


def host_facts() -> dict:
    """What may make one machine's host slower than another's at issuing the same step: CPU model and mean clock,
    the cores this process may use, the load, and this process's threads (Linux; fields it cannot read are left out).
    """
    facts = {"cores": len(os.sched_getaffinity(0)), "load": os.getloadavg()}
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        facts["threads"] = len(os.listdir("/proc/self/task"))
    except OSError:
        return facts
    if model := re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.MULTILINE):
        facts["cpu"] = model.group(1).strip()
    if clocks := re.findall(r"^cpu MHz\s*:\s*([\d.]+)$", cpuinfo, re.MULTILINE):
        facts["mhz"] = round(statistics.mean(map(float, clocks)))
    return facts


class PhaseClock:
    """Host and GPU time of each phase of a step: a host timestamp and a CUDA event at each phase boundary."""

    PHASES = ("forward", "backward", "optimizer")

    def __init__(self) -> None:
        self.host: list[float] = []
        self.events: list[torch.cuda.Event] = []
        self.mark()

    def mark(self) -> None:
        self.events.append(torch.cuda.Event(enable_timing=True))
        self.events[-1].record()
        self.host.append(time.perf_counter())

    def phases(self) -> dict[str, list[float]]:
        """Per phase, ms the host took to issue it and ms between its boundaries on the GPU (once synchronised)."""
        pairs = list(zip(range(len(self.host) - 1), range(1, len(self.host)), strict=True))
        return {
            "host": [(self.host[b] - self.host[a]) * 1e3 for a, b in pairs],
            "gpu": [self.events[a].elapsed_time(self.events[b]) for a, b in pairs],
        }


def run(
    preset: str,
    variant: str,
    precision: str,
    steps: int,
    warmup: int,
    with_profile: bool = False,
    compiled_autograd: bool = False,
    options: dict | None = None,
    trace: str | None = None,
) -> dict:
    cfg = ModelConfig.preset(preset, max_seq_len=SEQ_LEN)
    name, kwargs = VARIANTS[variant]
    model = Decoder(cfg, make_residual(name, **kwargs)).cuda()
    compile_blocks(model, options)
    if precision == "fsdp-bf16":
        apply_fsdp(model, init_device_mesh("cuda", (1,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, cfg.vocab_size, (BATCH[preset], SEQ_LEN + 1), generator=gen).cuda()
    x, y = data[:, :-1], data[:, 1:]

    def step(clock: PhaseClock | None = None) -> None:
        phase = gpu_idle.phase_range
        with phase("forward"), torch.autocast("cuda", torch.bfloat16, enabled=precision == "autocast"):
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        if clock:
            clock.mark()
        with phase("backward"), compiled_backward(compiled_autograd, options):
            loss.backward()
        if clock:
            clock.mark()
        with phase("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    graphs = counters["stats"]["unique_graphs"]
    facts = host_facts()
    times, host, phases = [], [], []
    for _ in range(steps):
        clock = PhaseClock()
        step(clock)
        clock.mark()
        clock.events[-1].synchronize()
        host.append(clock.host[-1] - clock.host[0])
        times.append(clock.events[0].elapsed_time(clock.events[-1]) * 1e-3)
        phases.append(clock.phases())
    peak = torch.cuda.max_memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):  # back to back: the host runs ahead, so a host that keeps up leaves the GPU no gaps
        step()
    end.record()
    end.synchronize()
    pipelined_s = start.elapsed_time(end) * 1e-3 / steps
    kernels = profile(step, f"{preset} {variant} {precision}", trace) if with_profile else None
    tokens = BATCH[preset] * SEQ_LEN
    row = {
        "preset": preset,
        "variant": variant,
        "precision": precision,
        "batch": BATCH[preset],
        "step_s": statistics.median(times),
        "tok_s": tokens / statistics.median(times),
        "tok_s_pipelined": tokens / pipelined_s,
        "peak_gib": peak / 2**30,
        "compile_s": compile_s,
        "host_s": statistics.median(host),  # Python's time to issue a step: near step_s means host-bound
        "host_s_steps": host,
        "graphs_compiled_in_timed_steps": counters["stats"]["unique_graphs"] - graphs,  # 0 unless recompiling
        "host": facts,  # before the timed steps
        "phase_ms": {  # medians: a phase whose GPU time is close to its host time waited on the host
            f"{phase} {side}": statistics.median(p[side][i] for p in phases)
            for i, phase in enumerate(PhaseClock.PHASES)
            for side in ("host", "gpu")
        },
    }
    if kernels is not None:
        row["kernels_ms"] = sum(k[2] for k in kernels)  # device time of one profiled step's kernels
        row["gpu_busy"] = row["kernels_ms"] * 1e-3 / row["step_s"]  # of a timed step, the kernels' share
        row["kernels"] = kernels
    return row


def print_summary(rows: list[dict]) -> None:
    """One line per preset, precision and variant: medians over repeats, and ratios to `sum` of the same repeat
    (their median, and their range when there are several repeats). `pipelined` is the ratio of back-to-back steps;
    `kernels` (with --profile) the ratio of one profiled step's kernel time, which no host speed moves; `opt host` is
    the optimizer phase's host time, the same work in every variant: a high one marks a slow process, whose
    synchronised ratio measures its host (benchmarks/RESULTS.md, v26)."""
    print(
        f"{'preset':>6} {'precision':>9} {'variant':>16} {'tok/s':>9} {'x sum':>6} {'range':>13} {'peak GiB':>9} "
        f"{'x sum':>6} {'step ms':>8} {'host ms':>8} {'opt host':>8} {'pipelined':>9} {'kernels':>7} {'compile s':>9}"
    )
    keys = list(dict.fromkeys((r["preset"], r["precision"], r["variant"]) for r in rows))
    for preset, precision, variant in keys:
        mine = [r for r in rows if (r["preset"], r["precision"], r["variant"]) == (preset, precision, variant)]
        bases = {
            r["repeat"]: r for r in rows if (r["preset"], r["precision"], r["variant"]) == (preset, precision, "sum")
        }
        paired = [(r, bases.get(r["repeat"], r)) for r in mine]
        speed = [r["tok_s"] / b["tok_s"] for r, b in paired]
        memory = [r["peak_gib"] / b["peak_gib"] for r, b in paired]
        pipelined = [r["tok_s_pipelined"] / b["tok_s_pipelined"] for r, b in paired]
        by_kernels = [b["kernels_ms"] / r["kernels_ms"] for r, b in paired if "kernels_ms" in r and "kernels_ms" in b]
        spread = f"{min(speed):.3f}-{max(speed):.3f}" if len(speed) > 1 else ""
        opt_host = statistics.median(r["phase_ms"]["optimizer host"] for r in mine)
        kernel_ratio = f"{statistics.median(by_kernels):.3f}" if by_kernels else ""
        print(
            f"{preset:>6} {precision:>9} {variant:>16} {statistics.median(r['tok_s'] for r in mine):9.0f} "
            f"{statistics.median(speed):6.3f} {spread:>13} {max(r['peak_gib'] for r in mine):9.2f} "
            f"{statistics.median(memory):6.3f} {statistics.median(r['step_s'] for r in mine) * 1e3:8.1f} "
            f"{statistics.median(r['host_s'] for r in mine) * 1e3:8.1f} {opt_host:8.2f} "
            f"{statistics.median(pipelined):9.3f} {kernel_ratio:>7} {mine[0]['compile_s']:9.1f}"
        )


def inductor_option(item: str, parser: argparse.ArgumentParser) -> tuple[str, object]:
    """`KEY=VALUE` as a torch._inductor.config entry (VALUE a Python literal, else a string)."""
    key, sep, text = item.partition("=")
    if not sep:
        parser.error(f"--inductor {item}: use KEY=VALUE, e.g. combo_kernels=True")
    try:
        return key, ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return key, text


def run_in_child(args: argparse.Namespace, preset: str, precision: str, variant: str) -> dict:
    """`run` in a fresh Python process (this script with `--child`), so no earlier run's state slows it."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        cmd = [sys.executable, __file__, "--presets", preset, "--precisions", precision, "--variants", variant]
        cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--child", str(out)]
        cmd += ["--profile"] * args.profile + ["--compiled-autograd"] * args.compiled_autograd
        cmd += ["--trace", args.trace] if args.trace else []
        for item in args.inductor:
            cmd += ["--inductor", item]
        subprocess.run(cmd, check=True)
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="100m,350m,1b")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--precisions", default="autocast", help="autocast and/or fsdp-bf16, comma-separated")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument(
        "--profile", action="store_true", help="print each variant's GPU time per kernel (all kernels go to --out)"
    )
    parser.add_argument(
        "--trace", default=None, metavar="DIR", help="with --profile: write each profiled step's chrome trace here"
    )
    parser.add_argument("--repeats", type=int, default=1, help="run the whole list this many times")
    parser.add_argument(
        "--compiled-autograd",
        action="store_true",
        help="capture each backward whole (torch's compiled autograd), for every variant of the run",
    )
    parser.add_argument("--one-process", action="store_true", help="run every variant in this process")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one run; its row goes to this file
    parser.add_argument(
        "--inductor",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override or add an Inductor option for every variant (repeatable), e.g. combo_kernels=False",
    )
    args = parser.parse_args()
    try:
        inductor = inductor_options(INDUCTOR_OPTIONS | dict(inductor_option(item, parser) for item in args.inductor))
    except ValueError as error:
        parser.error(f"--inductor: {error}")
    if args.trace and not args.profile:
        parser.error("--trace needs --profile: it writes the profiled step's trace")
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: use 1 or more")
    precisions = args.precisions.split(",")
    unknown = set(precisions) - {"autocast", "fsdp-bf16"}
    if unknown:
        parser.error(f"unknown precision {sorted(unknown)}: use autocast and/or fsdp-bf16")
    for name, given, known in (("preset", args.presets, BATCH), ("variant", args.variants, VARIANTS)):
        unknown = sorted(set(given.split(",")) - set(known))
        if unknown:
            parser.error(f"unknown {name} {unknown}: use some of {','.join(known)}")
    in_process = args.one_process or args.child is not None
    if in_process:  # the process that builds and compiles the models
        if "fsdp-bf16" in precisions:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29517")
            dist.init_process_group("nccl", rank=0, world_size=1)
        allow_recompiles()
        torch.backends.cuda.matmul.allow_tf32 = True
    if args.child is None:
        print(
            f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
            f"MHAR_ROUTE_BACKEND={os.environ.get('MHAR_ROUTE_BACKEND', 'auto')}  inductor {inductor}",
            flush=True,
        )
    rows, settings = [], (args.steps, args.warmup, args.profile, args.compiled_autograd, inductor, args.trace)
    runs = [(p, c, v) for p in args.presets.split(",") for c in precisions for v in args.variants.split(",")]
    for repeat, (preset, precision, variant) in itertools.product(range(args.repeats), runs):
        if in_process:
            row = run(preset, variant, precision, *settings)
            gc.collect()  # the model and optimizer of `run` are garbage now: give their memory back
            torch.cuda.empty_cache()
            torch._dynamo.reset()
        else:
            row = run_in_child(args, preset, precision, variant)
        row |= {"repeat": repeat, "compiled_autograd": args.compiled_autograd, "inductor": inductor}
        rows.append(row)
        if args.child is not None:
            Path(args.child).write_text(json.dumps(row))
            continue
        print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)  # the kernels go to --out
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
    if args.child is None:
        print_summary(rows)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
