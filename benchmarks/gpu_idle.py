"""Where a profiled step's GPU sat idle, read from a chrome trace (`torch.profiler.profile(...).export_chrome_trace`).

A gap between GPU events is host-bound when the kernel after it was launched only after the GPU had run dry (the GPU
waited for the host to issue it), and GPU-side otherwise (a wait on an event, a copy, another stream). Gaps are split
by the phase that launched the next kernel (`record_function("phase_<name>")` ranges, as `throughput.py` marks them),
and the host ops that ran on the launching thread during host-bound gaps are summed by name (nested ops each count):
what the host was doing while the GPU waited. Profile without `with_stack` for these sums: the profiler's Python
tracer can leave calls open to the end of the trace (seen with torch 2.11: autograd `Function.apply` in a compiled
forward), which then overlap every later gap.

    python benchmarks/gpu_idle.py TRACE.json[.gz] [--top 25]
"""

import argparse
import collections
import gzip
import json
from dataclasses import dataclass

import torch

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
RUNTIME_CATEGORIES = ("cuda_runtime", "cuda_driver")
HOST_CATEGORIES = ("cpu_op", "python_function", "user_annotation")
PHASE_PREFIX = "phase_"


def phase_range(name: str) -> torch.profiler.record_function:
    """A profiler range that marks a phase of a step for `analyse` (next to nothing when no profiler runs)."""
    return torch.profiler.record_function(PHASE_PREFIX + name)


@dataclass
class Gap:
    us: float
    phase: str
    host_bound: bool
    next_kernel: str


@dataclass
class IdleReport:
    span_us: float  # first GPU event's start to last one's end
    busy_us: float  # GPU events' summed time (overlaps across streams count twice)
    idle_us: dict[tuple[str, bool], float]  # by (phase, host-bound)
    gaps: list[Gap]
    host_ops_us: collections.Counter  # host op name -> us it overlapped host-bound gaps
    runtime: dict[str, tuple[int, float, float]]  # name -> (calls, total us, longest us)


def load_events(path: str) -> list[dict]:
    """The complete ("X") events of a chrome trace, gzipped or not."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def _phase(phases: list[dict], t: float) -> str:
    for p in phases:
        if p["ts"] <= t <= p["ts"] + p["dur"]:
            return p["name"][len(PHASE_PREFIX) :]
    return "other"


def _overlaps(ops: list[dict], holes: list[tuple[float, float]], into: collections.Counter) -> None:
    """Add each op's overlap with the holes (sorted ops and holes: one sweep) to `into`, by op name."""
    i, active = 0, []
    for a, b in sorted(holes):
        while i < len(ops) and ops[i]["ts"] < b:
            active.append(ops[i])
            i += 1
        active = [o for o in active if o["ts"] + o["dur"] > a]
        for o in active:
            if (overlap := min(o["ts"] + o["dur"], b) - max(o["ts"], a)) > 0:
                into[o["name"]] += overlap


def analyse(events: list[dict], min_gap_us: float = 2.0) -> IdleReport:
    """Split the GPU's idle time in `events` (from `load_events`) into host-bound and GPU-side gaps, by phase."""
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])
    if not gpu:
        raise ValueError("no GPU events in the trace: profile on a GPU with ProfilerActivity.CUDA among the activities")
    launches = {e["args"]["correlation"]: e for e in events if e.get("cat") in RUNTIME_CATEGORIES and "args" in e}
    phases = [e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith(PHASE_PREFIX)]
    ops_by_thread = collections.defaultdict(list)
    for e in sorted((e for e in events if e.get("cat") in HOST_CATEGORIES), key=lambda e: e["ts"]):
        if not e["name"].startswith(PHASE_PREFIX):
            ops_by_thread[e["tid"]].append(e)
    idle, gaps, holes = collections.defaultdict(float), [], collections.defaultdict(list)
    end = gpu[0]["ts"] + gpu[0]["dur"]
    for e in gpu[1:]:
        if (gap := e["ts"] - end) > min_gap_us:
            launch = launches.get(e.get("args", {}).get("correlation"))
            issued = launch["ts"] + launch["dur"] if launch else None
            host_bound = issued is not None and issued > end
            phase = _phase(phases, launch["ts"] if launch else e["ts"])
            idle[phase, host_bound] += gap
            gaps.append(Gap(gap, phase, host_bound, e["name"]))
            if host_bound:
                holes[launch["tid"]].append((end, launch["ts"]))
        end = max(end, e["ts"] + e["dur"])
    host_ops = collections.Counter()
    for tid, tid_holes in holes.items():
        _overlaps(ops_by_thread[tid], tid_holes, host_ops)
    runtime = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for e in events:
        if e.get("cat") in RUNTIME_CATEGORIES:
            r = runtime[e["name"]]
            r[0], r[1], r[2] = r[0] + 1, r[1] + e["dur"], max(r[2], e["dur"])
    return IdleReport(
        span_us=end - gpu[0]["ts"],
        busy_us=sum(e["dur"] for e in gpu),
        idle_us=dict(idle),
        gaps=gaps,
        host_ops_us=host_ops,
        runtime={name: tuple(r) for name, r in runtime.items()},
    )


def print_report(report: IdleReport, top: int = 25) -> None:
    print(
        f"GPU span {report.span_us / 1e3:.2f} ms, busy {report.busy_us / 1e3:.2f} ms, "
        f"idle {(report.span_us - report.busy_us) / 1e3:.2f} ms, of which {sum(report.idle_us.values()) / 1e3:.2f} ms "
        f"in {len(report.gaps)} gaps over the minimum"
    )
    for (phase, host_bound), us in sorted(report.idle_us.items()):
        print(f"  {phase:>10} {'host-bound' if host_bound else 'GPU-side':>10} {us / 1e3:8.2f} ms")
    print("largest gaps (us, phase, host-bound, next kernel):")
    for g in sorted(report.gaps, key=lambda g: -g.us)[:top]:
        print(f"  {g.us:8.0f} {g.phase:>10} {'host' if g.host_bound else 'GPU':>4} {g.next_kernel[:90]}")
    print("host ops during host-bound gaps (ms; nested ops each count):")
    for name, us in report.host_ops_us.most_common(top):
        print(f"  {us / 1e3:8.2f} {name[:100]}")
    print("CUDA runtime and driver calls (calls, total ms, longest us):")
    for name, (calls, total, longest) in sorted(report.runtime.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {calls:6d} {total / 1e3:8.2f} {longest:8.0f} {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="a chrome trace from torch.profiler (.json or .json.gz)")
    parser.add_argument("--top", type=int, default=25, help="rows per table")
    parser.add_argument("--min-gap-us", type=float, default=2.0, help="shorter gaps count as busy")
    args = parser.parse_args()
    try:
        report = analyse(load_events(args.trace), args.min_gap_us)
    except (OSError, ValueError, KeyError) as error:  # missing or unreadable file, not JSON, not a chrome trace
        parser.error(f"{args.trace}: {error!r}; pass a chrome trace from torch.profiler's export_chrome_trace")
    print_report(report, args.top)


if __name__ == "__main__":
    main()
