"""`mhar compare`: train a grid of variants x seeds with `mhar fit`, resumably, and report on it."""

import argparse
import json
import logging
import shutil
import sys
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from mhar_lightning.arguments import ToolParser
from mhar_lightning.errors import MharError
from mhar_lightning.study import plots, report, sizes
from mhar_lightning.study.continuation import convert_checkpoint
from mhar_lightning.study.grid import CHILDREN, LOG_FILE, RESULT_FILE, Run, Variant, mhar, parse_variant, run_dir
from mhar_lightning.study.results import RunResult, has_logs, initial_val_loss, read_run

STRATEGIES: dict[str, dict[str, Any] | str] = {
    "sum": "sum",
    "attnres-block": {"class_path": "mhar_lightning.residual.AttnRes", "init_args": {"blocks": 4}},
    "attnres-full": {"class_path": "mhar_lightning.residual.AttnRes", "init_args": {"blocks": None}},
    "mhar-block": {"class_path": "mhar_lightning.residual.MHAR", "init_args": {"heads": 4, "blocks": 4}},
    "mhar-full": {"class_path": "mhar_lightning.residual.MHAR", "init_args": {"heads": 4, "blocks": None}},
    "delta-mhar": {"class_path": "mhar_lightning.residual.DeltaMHAR", "init_args": {"heads": 4, "block_size": 1}},
    "hyper-connections": "hyper-connections",
}
"""Strategies by name; blocks and heads sized for the `tiny` preset (4 layers, d = 64). With no variants given,
`mhar compare` trains them all on the demo recipe for `TINY_OVERRIDES`."""

DEMO = Path(__file__).resolve().parents[2] / "recipes" / "demo.yaml"
TINY_OVERRIDES = [
    "--trainer.max_steps",
    "200",
    "--trainer.val_check_interval",
    "100",
    "--model.optimizer.warmup_steps",
    "20",
]
STUDY_FILE = "study.json"
"""The variants of a study, baseline first, for `--report-only DIR`."""
OWN_FLAGS = {"--recipe", "--seeds", "--out", "--baseline", "--only", "--max-runs", "--time-budget", "--report-only",
             "--continue-from", "--jobs", "--sizes"}  # fmt: skip


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the runner's own arguments, `--section.key value` overrides passed on to every `mhar fit`).

    An override takes one value (`--section.key value` or `--section.key=value`); other words are the runner's, so
    variants may come before or after the overrides.
    """
    own: list[str] = []
    overrides: list[str] = []
    takes_value = False
    for arg in argv:
        flag, has_value, _ = arg.partition("=")
        if takes_value and not arg.startswith("--"):
            overrides.append(arg)
            takes_value = False
        elif arg.startswith("--") and "." in flag and flag not in OWN_FLAGS:
            overrides.append(arg)
            takes_value = not has_value
        else:
            own.append(arg)
            takes_value = False
    return own, overrides


def seeds_last(own: list[str]) -> list[str]:
    """`own` with `--seeds` and its whole numbers moved to the end, so that in `--seeds 0 1 sum mhar` the words after
    the numbers stay variants, in their order."""
    rest: list[str] = []
    seeds: list[str] = []
    words = iter(own)
    for word in words:
        if word != "--seeds":
            rest.append(word)
            continue
        seeds.append(word)
        for word in words:
            if not word.isdigit():
                rest.append(word)
                break
            seeds.append(word)
    return rest + seeds


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = ToolParser(
        prog="mhar compare",
        description="Train every variant for every seed with `mhar fit` into OUT/runs/<variant>/seed<k>, skipping "
        "finished runs and resuming interrupted ones from last.ckpt, then write OUT/report.md, results.json and "
        "PNG plots from the runs' logs. Any other `--section.key value` is passed to every `mhar fit`.",
    )
    parser.add_argument(
        "variants",
        nargs="*",
        metavar="VARIANT",
        help=f"[NAME=]SPEC: a recipe (.yaml), one of {', '.join(STRATEGIES)}, a registered residual name or a "
        "class path, optionally with arguments (NAME=mhar:heads=2,blocks=8); default: all of the built-in ones",
    )
    parser.add_argument(
        "--recipe", type=Path, default=DEMO, help="recipe the strategy variants train with (default: the demo's)"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds of every variant (default: 0)")
    parser.add_argument("--out", type=Path, default=Path("runs/compare"), help="study folder (default: runs/compare)")
    parser.add_argument("--baseline", help="variant the others are compared with (default: the first)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="train only these variants (the report has all)")
    parser.add_argument("--max-runs", type=int, help="train at most this many runs in this call")
    parser.add_argument(
        "--time-budget",
        type=float,
        metavar="SECONDS",
        help="start no run that would end past this many seconds, judged by the longest run so far",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs trained at the same time, sharing the machine (e.g. several small models on one GPU; default: 1)",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=1,
        help="times a run that fails after writing a newer last.ckpt resumes from it in this call (default: 1)",
    )
    parser.add_argument(
        "--report-only",
        nargs="?",
        const="",
        metavar="DIR",
        help="train nothing: rebuild the report of the study in DIR (default: --out) from its finished runs",
    )
    parser.add_argument(
        "--sizes",
        nargs="+",
        type=Path,
        metavar="DIR",
        help="train nothing: write OUT/gap_vs_size.md and .png, each variant's gap to the baseline in the study "
        "folders DIR (one model size each, reported first) against the baseline's parameters",
    )
    parser.add_argument(
        "--continue-from",
        type=Path,
        metavar="DIR",
        help="start every run from DIR/seed<k>/checkpoints/last.ckpt converted to the variant's strategy",
    )
    own, overrides = split_overrides(argv)
    args = parser.parse_intermixed_args(seeds_last(own))
    if args.sizes:
        return args, overrides
    if args.report_only:
        args.out = Path(args.report_only)
    if not args.variants and args.report_only is None:
        args.variants = list(STRATEGIES)
        overrides = [*TINY_OVERRIDES, *overrides]
    if args.report_only is not None and not args.out.is_dir():
        parser.error(f"--report-only {args.out}: no such folder; pass the --out folder of an earlier `mhar compare`")
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: train at least one run at a time")
    if args.retries < 0:
        parser.error(f"--retries {args.retries}: pass 0 or more resumptions of a crashed run")
    if args.max_runs is not None and args.max_runs < 0:
        parser.error(f"--max-runs {args.max_runs}: pass 0 or more runs to train in this call")
    if args.time_budget is not None and args.time_budget <= 0:
        parser.error(f"--time-budget {args.time_budget:g}: pass the seconds this call may train, more than 0")
    if not args.recipe.is_file():
        parser.error(f"recipe {args.recipe} does not exist: pass --recipe <file>")
    return args, overrides


def grid(args: argparse.Namespace, overrides: list[str]) -> tuple[list[Variant], list[Run]]:
    """Variants and their runs, seed by seed (so a partly done study compares every variant on its first seeds)."""
    variants = [parse_variant(text, args.recipe, STRATEGIES) for text in args.variants]
    names = [v.name for v in variants]
    if len(set(names)) < len(names):
        raise ValueError(f"variant names repeat in {names}: name them, e.g. mhar-h2=mhar:heads=2")
    for name in [*(args.only or []), *([args.baseline] if args.baseline else [])]:
        if name not in names:
            raise ValueError(f"no variant named {name!r}; the variants are {', '.join(names)}")
    runs = []
    for seed in args.seeds:
        for variant in variants:
            init = None
            if args.continue_from is not None:
                if variant.residual is None:
                    raise ValueError(f"--continue-from needs strategy variants, not the recipe {variant.recipe}")
                init = run_dir(args.out, variant.name, seed) / "init"
            runs.append(Run(variant, seed, run_dir(args.out, variant.name, seed), overrides, init))
    return variants, runs


def prepare_continuation(run: Run, source: Path) -> None:
    """Convert the source run's last checkpoint into `run.init_from` and validate it into `<run>/initial`."""
    ckpt = source / f"seed{run.seed}" / "checkpoints" / "last.ckpt"
    if not ckpt.is_file():
        raise ValueError(f"{ckpt} does not exist: finish the source run first (or fix --continue-from)")
    if not (run.init_from / "mhar_config.json").is_file():
        if run.init_from.exists():
            shutil.rmtree(run.init_from)
        convert_checkpoint(ckpt, run.init_from, run.variant.residual)
    if initial_val_loss(run.dir) is None:
        args = ["validate", *run.base_args(), "--trainer.default_root_dir", str(run.dir / "initial")]
        mhar([*args, "--trainer.enable_progress_bar", "false"], run.dir / LOG_FILE)


def train_run(run: Run, continue_from: Path | None, jobs: int, retries: int) -> int:
    """Train one run to its end (resuming it if it has a `last.ckpt`) and record its result.

    An attempt that fails after writing a newer `last.ckpt` made progress (a crash, not a bad setting), so it
    resumes from that checkpoint, at most `retries` times. Returns the number of resumptions."""
    run.check_arguments()
    if run.init_from is not None:
        prepare_continuation(run, continue_from)
    for attempt in range(retries + 1):
        saved = checkpoint_time(run)
        try:
            mhar(run.fit_args(), run.dir / LOG_FILE)
            break
        except RuntimeError:
            if attempt == retries or CHILDREN.stopped or checkpoint_time(run) == saved:
                raise
    read_run(run.dir, run.variant.name, run.seed, run.variant.describe(), shared=jobs).save(run.dir)
    return attempt


def checkpoint_time(run: Run) -> float | None:
    return run.last_checkpoint.stat().st_mtime if run.last_checkpoint.is_file() else None


def train(runs: list[Run], args: argparse.Namespace, console: Console) -> list[str]:
    """Train the unfinished runs, `args.jobs` at a time, within the run-count and time limits.

    A run that fails is reported and left for the next call; the others go on. Returns the failed runs' labels.
    """
    for run in runs:
        if run.dir.is_dir():
            run.check_arguments()
    todo = [r for r in runs if not r.finished and (not args.only or r.variant.name in args.only)]
    if args.max_runs is not None:
        todo = todo[: args.max_runs]
    for run in todo:
        run.check_final_validation()
    jobs = min(args.jobs, len(todo))
    console.print(f"{sum(r.finished for r in runs)} of {len(runs)} runs finished; training {len(todo)} in this call")
    start, longest = time.monotonic(), 0.0
    columns = [
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    ]
    running: dict[Future, tuple[Run, float, str]] = {}
    failed = []
    CHILDREN.stopped = False
    with (
        Progress(*columns, console=console) as progress,
        CHILDREN.on_sigterm(),
        ThreadPoolExecutor(args.jobs) as pool,
    ):
        task = progress.add_task("study", total=len(todo))
        try:
            while todo or running:
                while todo and len(running) < jobs:
                    elapsed = time.monotonic() - start
                    if args.time_budget is not None and elapsed + longest > args.time_budget:
                        console.print(
                            f"time budget: stopping after {elapsed:.0f} s (the longest run took {longest:.0f} s)"
                        )
                        todo = []
                        break
                    run = todo.pop(0)
                    label = f"{run.variant.name} seed {run.seed}" + (
                        " (resuming)" if run.last_checkpoint.is_file() else ""
                    )
                    future = pool.submit(train_run, run, args.continue_from, jobs, args.retries)
                    running[future] = (run, time.monotonic(), label)
                progress.update(task, description=", ".join(label for _, _, label in running.values()))
                if not running:
                    break
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    run, began, label = running.pop(future)
                    progress.advance(task)
                    try:
                        resumed = future.result()
                    except (ValueError, RuntimeError) as error:
                        failed.append(label)
                        console.print(f"failed {label}: {error}", markup=False, highlight=False)
                        continue
                    longest = max(longest, time.monotonic() - began)
                    after = f" (resumed from last.ckpt after {resumed} failed attempt{'s' * (resumed > 1)})"
                    console.print(
                        f"finished {run.variant.name} seed {run.seed} in {time.monotonic() - began:.0f} s"
                        + (after if resumed else "")
                    )
        except BaseException:
            CHILDREN.kill_all()  # the other runs resume from their last.ckpt on the next call
            raise
    return failed


def recorded_order(study: Path) -> list[str]:
    """The variant order recorded in `study` by earlier calls (the baseline first), or none."""
    return json.loads((study / STUDY_FILE).read_text())["variants"] if (study / STUDY_FILE).is_file() else []


def study_order(study: Path, names: list[str], baseline: str | None) -> list[str]:
    """The recorded order with this call's new variants after it, so a study grown in several calls (the methods,
    then a head sweep) keeps its first baseline; `baseline`, when given, goes first."""
    order = recorded_order(study)
    order += [name for name in names if name not in order]
    return [baseline, *(name for name in order if name != baseline)] if baseline else order


def collect_all(study: Path, reread: bool, unfinished: set[Path]) -> tuple[list[RunResult], list[str]]:
    """Every finished run under `study/runs` (re-read from its logs where they are there and `reread` is set) and
    the variant order. `unfinished`: run folders whose result stops short of their `trainer.max_steps`."""
    order = recorded_order(study)
    results = []
    for path in sorted(study.glob(f"runs/*/seed*/{RESULT_FILE}")):
        if path.parent in unfinished:
            continue
        result = RunResult.load(path.parent)
        if reread and has_logs(path.parent):
            result = read_run(path.parent, result.variant, result.seed, result.definition, result.shared)
            result.save(path.parent)
        results.append(result)
    order += sorted({r.variant for r in results} - set(order))
    rank = {name: i for i, name in enumerate(order)}
    return sorted(results, key=lambda r: (r.seed, rank[r.variant])), order


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `mhar compare`; returns the process exit code. Lightning's info lines are silenced meanwhile."""
    args, overrides = parse_args(list(sys.argv[1:] if argv is None else argv))
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        return gap_vs_size(args.sizes, args.out) if args.sizes else study(args, overrides)
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def gap_vs_size(studies: list[Path], out: Path) -> int:
    """`--sizes`: the gap table and plot of several studies' reports, into `out`."""
    try:
        gaps = sizes.size_gaps(studies)
    except ValueError as error:
        print(f"mhar compare: error: {error}", file=sys.stderr)
        return MharError.exit_code
    out.mkdir(parents=True, exist_ok=True)
    (out / "gap_vs_size.md").write_text(sizes.markdown(gaps))
    sizes.figure(gaps).savefig(out / "gap_vs_size.png", dpi=sizes.DPI)
    print(sizes.markdown(gaps), end="")
    print(f"written: {out / 'gap_vs_size.md'}, {out / 'gap_vs_size.png'}")
    return 0


def study(args: argparse.Namespace, overrides: list[str]) -> int:
    """Train the study's unfinished runs (unless `--report-only`), then report every finished run."""
    console = Console() if Console().is_terminal else Console(width=200)  # a log file gets the whole table
    unfinished: set[Path] = set()
    failed: list[str] = []
    try:
        if args.variants:
            variants, runs = grid(args, overrides)
            order = study_order(args.out, [v.name for v in variants], args.baseline)
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / STUDY_FILE).write_text(json.dumps({"variants": order}) + "\n")
            if args.report_only is None:
                failed = train(runs, args, console)
            unfinished = {run.dir for run in runs if not run.finished}
        results, order = collect_all(args.out, args.report_only is not None, unfinished)  # earlier calls' runs too
    except (ValueError, RuntimeError) as error:
        print(f"mhar compare: error: {error}", file=sys.stderr)
        return MharError.exit_code
    if not results:
        console.print(f"no finished runs in {args.out}/runs yet" + (f"; {len(failed)} failed" if failed else ""))
        return MharError.exit_code
    baseline = args.baseline or next(name for name in order if any(r.variant == name for r in results))
    summaries = report.summarize(results, baseline)
    paths = plots.write_plots(args.out, results, summaries, baseline)
    path = report.write(args.out, results, summaries, baseline, paths)
    title = f"{len(results)} runs" + (f" ({len(unfinished)} still to train)" if unfinished else "")
    for table in report.console_tables(summaries, baseline, title, console.width):
        console.print(table)
    console.print(f"report: {path}")
    for line in report.suspect_runs(results):
        console.print(f"warning: {line}", markup=False, highlight=False, soft_wrap=True)
    if failed:
        failures = f"{len(failed)} runs failed ({', '.join(failed)})"
        console.print(f"mhar compare: error: {failures}; their logs say why", markup=False, soft_wrap=True)
        return MharError.exit_code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
