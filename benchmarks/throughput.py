"""Training throughput and peak memory of recipes, measured through `mhar fit`'s own path.

Each recipe runs as `mhar fit --config RECIPE` runs it: the same `MharCLI`, `LanguageModel`, `TokenDataModule`,
Trainer, callbacks and progress bar, on a prepared folder of random tokens of the recipe's tokenizer (so no corpus
is needed). After `--warmup` steps (the compile happens in the first) the next `--steps` steps are timed between
two device synchronisations; peak memory is `torch.cuda.max_memory_allocated` over those steps. Ratios are to the
first recipe of the list, in the same run.

    python benchmarks/throughput.py recipes/pretrain/350m-sum.yaml recipes/pretrain/350m-mhar.yaml \\
        [--steps 30] [--warmup 10] [--bare] [--probes] [--kernels 3] [--set model.compiled_autograd=false] \\
        [--out rows.json]

`--bare` also times each recipe's model in a hand-written loop (the same `LanguageModel`, data, optimizer,
schedule, clipping, precision and compile settings, without the Trainer): the Trainer's own cost is the ratio of
the two. `--probes` times one call of each depth-probe callback after the timed steps, as a share of the steps
between its calls. `--kernels N` profiles N more steps after the timed ones and reports the device time a step
spends in each kind of kernel (matmuls, attention, the kit's routing kernels, the compiler's generated kernels, the
optimizer, copies, other) and its costliest kernels. `--set KEY=VALUE` passes `--KEY VALUE` to every run.

Every run has its own process. Up to `--parallel` of them compile and warm up at the same time (compilation is
host work), then they take turns for their timed steps, so no run is timed while another uses the machine.
"""

import argparse
import contextlib
import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import numpy as np
import torch
import mhar_lightning.kernels.backward_kernels
import mhar_lightning.kernels.forward_kernel
import mhar_lightning.kernels.triton_merge
from mhar_lightning.callbacks.base import ProbeCallback
from mhar_lightning.callbacks.throughput import device_peak

from mhar_lightning.data.shards import ShardIndex, ShardWriter, TokenizerInfo, token_dtype
from mhar_lightning.data.tokenizer import load_tokenizer
from mhar_lightning.optim import build_optimizer
from mhar_lightning.parallel import compiled_backward
from mhar_lightning.terminal import quiet_third_party_noise
from mhar_lightning.trainer_cli import MharCLI


def random_corpus(directory: Path, tokenizer_name: str, tokens: int) -> Path:
    """A prepared folder of uniformly random token ids (train and val splits) for `tokenizer_name`."""
    tokenizer = load_tokenizer(tokenizer_name)
    directory.mkdir(parents=True, exist_ok=True)
    dtype, rng = token_dtype(tokenizer.vocab_size), np.random.default_rng(0)
    splits = {}
    for split, count in (("train", tokens), ("val", max(tokens // 16, 1 << 16))):
        writer = ShardWriter(directory, split, dtype, shard_tokens=1 << 27)
        writer.write(rng.integers(0, tokenizer.vocab_size, count))
        splits[split] = writer.close()
    documents = dict.fromkeys(splits, 1)
    ShardIndex(TokenizerInfo.of(tokenizer), dtype.name, splits, documents, {"source": "random"}).save(directory)
    return directory


class Turns:
    """Runs started together on one machine: each waits until all are warm (or gone), then times its steps holding
    a lock, so that no run is timed while another compiles or trains."""

    def __init__(self, directory: str, members: list[int], me: int) -> None:
        self.directory, self.members, self.me = Path(directory), members, me
        self._lock = None

    def mark(self, state: str) -> None:
        (self.directory / f"{self.me}.{state}").touch()

    def acquire(self) -> None:
        self.mark("ready")
        while any(
            not (self.directory / f"{i}.ready").exists() and not (self.directory / f"{i}.gone").exists()
            for i in self.members
        ):
            time.sleep(0.5)
        self._lock = open(self.directory / "lock", "w")  # noqa: SIM115 - released in release()
        fcntl.flock(self._lock, fcntl.LOCK_EX)

    def release(self) -> None:
        if self._lock is not None:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()
            self._lock = None


KERNEL_KINDS = (
    ("attention", ("flash", "fmha", "sdpa", "attention")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "wgmma")),
    ("optimizer", ("multi_tensor", "adam")),
    ("copy", ("memcpy", "memset")),
)
"""Kinds of kernel by a substring of their lower-cased name, tried in order (a cuDNN attention kernel names wgmma)."""
ROUTING_KERNELS = frozenset(
    name
    for module in (mhar_lightning.kernels.forward_kernel, mhar_lightning.kernels.backward_kernels,
                   mhar_lightning.kernels.triton_merge)
    for name in vars(module)
    if name.endswith("_kernel")
)  # fmt: skip
"""The kit's Triton kernels (its kernel modules' `*_kernel` functions), which run under their Python names."""


def kernel_kind(name: str) -> str:
    """`routing` (the kit's kernels), `compiled` (Inductor's generated `triton_*` kernels), a kind of
    `KERNEL_KINDS`, or `other`."""
    if name in ROUTING_KERNELS:
        return "routing"
    low = name.lower()
    if low.startswith("triton_"):
        return "compiled"
    return next((kind for kind, keys in KERNEL_KINDS if any(key in low for key in keys)), "other")


def kernel_breakdown(kernels: list[tuple[str, int, float]], steps: int, top: int = 25) -> dict:
    """Device time a step by kind of kernel and the `top` costliest kernels, from (name, calls, total us) per kernel
    name over `steps` profiled steps: {"step_ms", "kinds": {kind: ms}, "top": [[name, kind, ms, calls], ...]}."""
    kinds: dict[str, float] = {}
    for name, _, total_us in kernels:
        kind = kernel_kind(name)
        kinds[kind] = kinds.get(kind, 0.0) + total_us / 1e3 / steps
    costliest = sorted(kernels, key=lambda k: -k[2])[:top]
    return {
        "step_ms": sum(kinds.values()),
        "kinds": dict(sorted(kinds.items(), key=lambda item: -item[1])),
        "top": [[name, kernel_kind(name), us / 1e3 / steps, calls / steps] for name, calls, us in costliest],
    }


def device_kernels(profiler: torch.profiler.profile) -> list[tuple[str, int, float]]:
    """(name, calls, total device us) of every kernel, copy and memset a CUDA profile recorded."""
    return [
        (e.key, e.count, e.self_device_time_total)
        for e in profiler.key_averages()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0
    ]


class Window(L.Callback):
    """Time the optimizer steps `warmup + 1 .. warmup + steps` of a Trainer run; optionally time the probes, then
    profile the kernels of the next `kernels` steps."""

    def __init__(self, warmup: int, steps: int, turns: Turns, probes: bool, kernels: int = 0) -> None:
        self.warmup, self.steps, self.turns, self.probes, self.kernels = warmup, steps, turns, probes, kernels
        self.result: dict = {}
        self._t0 = 0.0
        self._profiler: torch.profiler.profile | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self.warmup:
            torch.cuda.synchronize()
            self.turns.acquire()
            torch.cuda.reset_peak_memory_stats()
            self._t0 = time.perf_counter()
        elif step == self.warmup + self.steps:
            torch.cuda.synchronize()
            self.result["seconds"] = time.perf_counter() - self._t0
            self.result["peak_bytes"] = torch.cuda.max_memory_allocated()
            if self.probes:
                self.result["probe_s"] = time_probes(trainer, pl_module)
            if self.kernels:
                torch.cuda.synchronize()
                self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                self._profiler.start()
            else:
                self.turns.release()
        elif self._profiler is not None and step == self.warmup + self.steps + self.kernels:
            torch.cuda.synchronize()
            self._profiler.stop()
            self.result["kernels"] = kernel_breakdown(device_kernels(self._profiler), self.kernels)
            self._profiler = None
            self.turns.release()


def time_probes(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, float]:
    """Seconds of one call of each probe callback (the second of two: the first warms its code paths up)."""
    seconds = {}
    for callback in trainer.callbacks:
        if isinstance(callback, ProbeCallback):
            times = []
            for _ in range(2):
                torch.cuda.synchronize()
                start = time.perf_counter()
                callback.probe(trainer, pl_module)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            seconds[type(callback).__name__] = times[-1]
    return seconds


def run_trainer(cli: MharCLI, window: Window) -> None:
    """`mhar fit` as the CLI runs it, with the timing window added to the recipe's callbacks."""
    cli.trainer.callbacks.append(window)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)


def run_bare(cli: MharCLI, warmup: int, steps: int, turns: Turns) -> dict:
    """The recipe's model, data, optimizer, schedule and clipping in a hand-written loop: no Trainer, no callbacks."""
    model, data = cli.model, cli.datamodule
    if str(cli.trainer.precision) not in ("bf16-mixed", "32-true"):
        raise SystemExit(f"--bare supports precision bf16-mixed or 32-true, not {cli.trainer.precision}")
    model.configure_model()
    model.cuda()
    optimizer, scheduler = build_optimizer(model.decoder, model.optimizer_config, warmup + steps)
    data.setup("fit")
    batches = iter(data.train_dataloader())
    autocast = torch.autocast("cuda", torch.bfloat16) if "bf16" in str(cli.trainer.precision) else None
    result = {}
    for step in range(1, warmup + steps + 1):
        batch = next(batches).cuda(non_blocking=True)
        with autocast or contextlib.nullcontext():
            loss = model.loss(batch)
        with compiled_backward(model.compiled_autograd, model.parallel_config.compile_options):
            loss.backward()
        if model.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.decoder.parameters(), model.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step == warmup:
            torch.cuda.synchronize()
            turns.acquire()
            torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
    torch.cuda.synchronize()
    result["seconds"] = time.perf_counter() - start
    result["peak_bytes"] = torch.cuda.max_memory_allocated()
    turns.release()
    return result


def child(spec: dict) -> dict:
    """One run: build the recipe's CLI objects as `mhar fit` does, then time it in the Trainer or bare."""
    turns = Turns(spec["turns"], spec["members"], spec["index"])
    try:
        args = ["--config", spec["recipe"], *spec["args"], "--data.path", spec["corpus"]]
        max_steps = spec["warmup"] + spec["steps"] + spec["kernels"]
        args += ["--trainer.max_steps", str(max_steps), "--trainer.default_root_dir", spec["root"]]
        args += ["--checkpoint.save_last", "false", "--trainer.limit_val_batches", "0"]
        cli = MharCLI(args=args, run=False)
        if spec["bare"]:
            result = run_bare(cli, spec["warmup"], spec["steps"], turns)
        else:
            window = Window(spec["warmup"], spec["steps"], turns, spec["probes"], spec["kernels"])
            run_trainer(cli, window)
            result = window.result
        model, data = cli.model, cli.datamodule
        tokens = spec["steps"] * data.batch_size * data.seq_len
        flops = model.model_config.flops_per_token(data.seq_len) * tokens
        peak = device_peak(torch.device("cuda"), cli.trainer, model)
        return {
            "recipe": spec["label"],
            "loop": "bare" if spec["bare"] else "trainer",
            "preset": model.hparams.preset,
            "residual": model.residual.spec(),
            "compile": model.parallel_config.compile,
            "compiled_autograd": model.compiled_autograd,
            "batch": data.batch_size,
            "seq_len": data.seq_len,
            "step_ms": result["seconds"] / spec["steps"] * 1e3,
            "tok_s": tokens / result["seconds"],
            "mfu": flops / result["seconds"] / peak if peak else None,
            "peak_gib": result["peak_bytes"] / 2**30,
            "probe_s": result.get("probe_s", {}),
            "kernels": result.get("kernels"),
            "every_n_steps": {
                type(c).__name__: c.every_n_steps for c in cli.trainer.callbacks if isinstance(c, ProbeCallback)
            },
        }
    finally:
        turns.release()
        turns.mark("gone")


def summary(rows: list[dict]) -> str:
    """A Markdown table: each row against the first row of the same loop and preset (a recipe's own options kept)."""
    lines = [
        "| recipe | loop | tokens/s | x first | MFU | step ms | peak GiB | x first | probes (% of steps) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    firsts = {}
    for row in rows:
        first = firsts.setdefault((row["loop"], row["preset"]), row)
        probes = ", ".join(
            f"{name} {seconds * 1e3:.0f} ms ({share:.2f} %)"
            for name, seconds in row["probe_s"].items()
            for share in [100 * seconds / (row["every_n_steps"][name] * row["step_ms"] / 1e3)]
        )
        mfu = f"{row['mfu']:.3f}" if row["mfu"] else ""
        name = row["recipe"].removeprefix("recipes/")
        lines.append(
            f"| {name} | {row['loop']} | {row['tok_s']:,.0f} | {row['tok_s'] / first['tok_s']:.3f} "
            f"| {mfu} | {row['step_ms']:.1f} | {row['peak_gib']:.2f} | {row['peak_gib'] / first['peak_gib']:.3f} "
            f"| {probes} |"
        )
    profiled = [row for row in rows if row.get("kernels")]
    if profiled:
        kinds = sorted({kind for row in profiled for kind in row["kernels"]["kinds"]})
        lines += ["", "Device time a step by kind of kernel (ms); x first: the first row's speed in device time:", ""]
        lines += [f"| recipe | {' | '.join(kinds)} | all | x first |", "| --- |" + " ---: |" * (len(kinds) + 2)]
        firsts = {}
        for row in profiled:
            first = firsts.setdefault((row["loop"], row["preset"]), row)
            times = [row["kernels"]["kinds"].get(kind, 0.0) for kind in kinds] + [row["kernels"]["step_ms"]]
            ratio = first["kernels"]["step_ms"] / row["kernels"]["step_ms"]
            name = row["recipe"].removeprefix("recipes/")
            lines.append(f"| {name} | " + " | ".join(f"{t:.2f}" for t in times) + f" | {ratio:.3f} |")
    return "\n".join(lines)


def recipe_items(item: str) -> list[str]:
    """`RECIPE:KEY=VALUE[:KEY=VALUE]` split at the colons outside JSON values, so a value may be a strategy with its
    arguments: `model.residual={"class_path": "mhar_lightning.residual.MHAR", "init_args": {"blocks": 8}}`."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(item):
        depth += (char in "{[") - (char in "}]")
        if char == ":" and depth == 0:
            parts.append(item[start:index])
            start = index + 1
    return [*parts, item[start:]]


def flags(items: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`KEY=VALUE` items as command-line flags `--KEY VALUE`."""
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"{item}: use KEY=VALUE, e.g. model.compile=false")
        out += [f"--{key}", value]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "recipes",
        nargs="*",
        help="recipe files, each optionally RECIPE:KEY=VALUE[:KEY=VALUE] (VALUE may be JSON); ratios are to the first",
    )
    parser.add_argument("--steps", type=int, default=30, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=10, help="optimizer steps before the timed ones")
    parser.add_argument("--bare", action="store_true", help="also time each recipe's model without the Trainer")
    parser.add_argument("--probes", action="store_true", help="time one call of each depth-probe callback")
    parser.add_argument("--kernels", type=int, default=0, metavar="N", help="profile N steps: device time by kernel")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="--KEY VALUE for every run")
    parser.add_argument("--parallel", type=int, default=4, help="runs that compile at the same time")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        quiet_third_party_noise()  # the runs' output reads as `mhar fit`'s does
        spec = json.loads(Path(args.child).read_text())
        Path(spec["out"]).write_text(json.dumps(child(spec)))
        return
    if not args.recipes:
        parser.error("name at least one recipe")
    if not torch.cuda.is_available():
        parser.error("the throughput benchmark needs a CUDA GPU")
    if args.steps < 1 or args.warmup < 1 or args.kernels < 0:
        parser.error("--steps and --warmup must be >= 1, --kernels >= 0")
    overrides = flags(args.set, parser)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  lightning {L.__version__}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpora, specs = {}, []
        loops = [False, True] if args.bare else [False]
        for bare in loops:
            for item in args.recipes:
                recipe, *sets = recipe_items(item)
                spec = {"label": item, "recipe": recipe, "args": overrides + flags(sets, parser), "bare": bare}
                kernels = 0 if bare else args.kernels
                spec |= {"probes": args.probes and not bare, "kernels": kernels}
                specs.append(spec | {"steps": args.steps, "warmup": args.warmup})
        for index, spec in enumerate(specs):
            probe = MharCLI(args=["--config", spec["recipe"], *spec["args"]], run=False).datamodule
            per_run = (args.warmup + args.steps + args.kernels + 8) * probe.batch_size * (probe.seq_len + 1) * 2
            key = probe.tokenizer_name
            if key not in corpora:
                corpora[key] = str(random_corpus(tmp / f"corpus{len(corpora)}", key, per_run))
            wave = range(index - index % args.parallel, min(index - index % args.parallel + args.parallel, len(specs)))
            spec |= {"corpus": corpora[key], "index": index, "members": list(wave), "turns": str(tmp / "turns")}
            spec |= {"root": str(tmp / f"run{index}"), "out": str(tmp / f"row{index}.json")}
        (tmp / "turns").mkdir()
        rows = launch(specs, args.parallel, tmp)
    print(summary(rows), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


def launch(specs: list[dict], parallel: int, tmp: Path) -> list[dict]:
    """Run every spec in its own process, in waves of `parallel` started together; rows in the order of `specs`."""
    failed = []
    for first in range(0, len(specs), parallel):
        running = []
        for spec in specs[first : first + parallel]:
            path = tmp / f"spec{spec['index']}.json"
            path.write_text(json.dumps(spec))
            running.append((subprocess.Popen([sys.executable, __file__, "--child", str(path)]), spec))
        for process, spec in running:
            if process.wait():
                failed.append(spec["recipe"])
                (Path(spec["turns"]) / f"{spec['index']}.gone").touch()
            elif Path(spec["out"]).exists():
                print(Path(spec["out"]).read_text(), flush=True)  # each row as it is measured
    if failed:
        print(f"failed: {failed}", file=sys.stderr, flush=True)
    return [json.loads(Path(s["out"]).read_text()) for s in specs if Path(s["out"]).exists()]


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
