"""A study's report: per-variant means and seed spreads, paired gaps to the baseline, as Markdown, JSON and rich."""

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.table import Table

from mhar_lightning.run_environment import PACKAGES
from mhar_lightning.study import cost
from mhar_lightning.study.results import RunResult, finite

TRAIN_TAIL = 0.1
"""The final training loss is the mean of the logged values in this last fraction of a run's steps."""
SUSPECT_VAL_RATIO = 1.5
"""A run whose final validation loss exceeds its final training loss by this factor is named as one to check."""


def suspect_runs(runs: list[RunResult]) -> list[str]:
    """One line per run whose validation loss is far above its own training loss: a validation that does not
    measure the trained model, or a model that memorised its training data."""
    lines = []
    for run in runs:
        train = train_tail(run)
        if finite(train) and train > 0 and run.val_loss > SUSPECT_VAL_RATIO * train:
            lines.append(
                f"{run.variant} seed {run.seed}: validation loss {run.val_loss:.4f} is {run.val_loss / train:.1f}x"
                f" its training loss {train:.4f} (last {TRAIN_TAIL:.0%} of steps); check its validation before"
                " reading its numbers"
            )
    return lines


def mean_sd(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (None for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def train_tail(run: RunResult) -> float | None:
    """Mean training loss over the last `TRAIN_TAIL` of the run's steps (else the last logged one, if any)."""
    start = run.steps * (1 - TRAIN_TAIL)
    tail = [loss for step, loss in run.train_curve if step >= start] or [loss for _, loss in run.train_curve[-1:]]
    return statistics.fmean(tail) if tail else None


@dataclass
class VariantSummary:
    """One variant over its seeds; the gap to the baseline is paired by seed (same seed, same data order)."""

    variant: str
    definition: str
    seeds: list[int]
    params: int
    routing_params: int
    tokens: int
    val_loss: float
    val_loss_sd: float | None
    val_bpb: float | None
    val_bpb_sd: float | None
    downstream: dict[str, tuple[float, float | None]]
    """Task -> mean accuracy and its standard deviation over the seeds that logged it."""
    gap: float | None
    gap_sd: float | None
    tokens_per_sec: float | None
    speed_ratio: float | None
    peak_memory_gib: float | None
    memory_ratio: float | None
    initial_val_loss: float | None
    initial_gap: float | None


def ratio(value: float | None, base: float | None) -> float | None:
    return value / base if finite(value) and finite(base) and base else None


def mean_of(values: list[float | None]) -> float | None:
    present = [v for v in values if finite(v)]
    return statistics.fmean(present) if present else None


def alone_speed(runs: list[RunResult]) -> float | None:
    """Mean tokens/s of the `runs` that had their machine to themselves (None if none did)."""
    return mean_of([r.tokens_per_sec for r in runs if r.shared == 1])


def mean_sd_of(values: list[float | None]) -> tuple[float | None, float | None]:
    """`mean_sd` of the finite values (None, None when there are none)."""
    present = [v for v in values if finite(v)]
    return mean_sd(present) if present else (None, None)


def summarize(runs: list[RunResult], baseline: str) -> list[VariantSummary]:
    """Per-variant summaries in the order variants first appear in `runs`."""
    by_variant: dict[str, list[RunResult]] = {}
    for run in runs:
        by_variant.setdefault(run.variant, []).append(run)
    base = {run.seed: run for run in by_variant.get(baseline, [])}
    base_speed = alone_speed(list(base.values()))
    base_memory = mean_of([r.peak_memory_gib for r in base.values()])
    summaries = []
    for name, group in by_variant.items():
        group = sorted(group, key=lambda r: r.seed)
        val, val_sd = mean_sd([r.val_loss for r in group])
        paired = [r.val_loss - base[r.seed].val_loss for r in group if r.seed in base]
        gap, gap_sd = mean_sd(paired) if paired else (None, None)
        initial = [
            r.initial_val_loss - base[r.seed].initial_val_loss
            for r in group
            if r.seed in base and finite(r.initial_val_loss) and finite(base[r.seed].initial_val_loss)
        ]
        speed, memory = alone_speed(group), mean_of([r.peak_memory_gib for r in group])
        bpb, bpb_sd = mean_sd_of([r.val_bpb for r in group])
        tasks = sorted({task for r in group for task in r.downstream})
        summaries.append(
            VariantSummary(
                variant=name,
                definition=group[0].definition,
                seeds=[r.seed for r in group],
                params=group[0].params,
                routing_params=group[0].routing_params,
                tokens=group[0].tokens,
                val_loss=val,
                val_loss_sd=val_sd,
                val_bpb=bpb,
                val_bpb_sd=bpb_sd,
                downstream={task: mean_sd_of([r.downstream.get(task) for r in group]) for task in tasks},
                gap=gap,
                gap_sd=gap_sd,
                tokens_per_sec=speed,
                speed_ratio=ratio(speed, base_speed),
                peak_memory_gib=memory,
                memory_ratio=ratio(memory, base_memory),
                initial_val_loss=mean_of([r.initial_val_loss for r in group]),
                initial_gap=max(initial, key=abs) if initial else None,
            )
        )
    return summaries


def pm(value: float | None, sd: float | None, digits: int = 4, sign: bool = False) -> str:
    """`value ± sd` (just the value for one seed; `-` when missing)."""
    if value is None:
        return "-"
    text = f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"
    return text if sd is None else f"{text} ± {sd:.{digits}f}"


def num(value: float | None, fmt: str) -> str:
    return "-" if not finite(value) else format(value, fmt)


def summary_rows(summaries: list[VariantSummary], baseline: str) -> tuple[list[str], list[list[str]]]:
    """Header and cells of the summary table (shared by the Markdown report and the console table)."""
    header = [
        "variant", "seeds", "params", "routing params", "tokens", "val loss", f"vs {baseline}", "val bpb",
        "tokens/s", "speed", "peak GiB", "memory",
    ]  # fmt: skip
    rows = [
        [
            s.variant,
            str(len(s.seeds)),
            f"{s.params:,}",
            f"{s.routing_params:,}",
            f"{s.tokens:,}",
            pm(s.val_loss, s.val_loss_sd),
            pm(s.gap, s.gap_sd, sign=True),
            pm(s.val_bpb, s.val_bpb_sd),
            num(s.tokens_per_sec, ",.0f"),
            num(s.speed_ratio, ".2f") + ("x" if finite(s.speed_ratio) else ""),
            num(s.peak_memory_gib, ".2f"),
            num(s.memory_ratio, ".2f") + ("x" if finite(s.memory_ratio) else ""),
        ]
        for s in summaries
    ]
    return header, rows


def markdown_table(header: list[str], rows: list[list[str]], text_columns: int = 1) -> list[str]:
    """Markdown table lines; the first `text_columns` columns are left-aligned, the numbers right-aligned."""
    align = ["---" if i < text_columns else "---:" for i in range(len(header))]
    return [f"| {' | '.join(cells)} |" for cells in (header, align, *rows)]


def console_tables(summaries: list[VariantSummary], baseline: str, title: str, width: int) -> list[Table]:
    """The summary table for a terminal `width` characters wide: the columns that do not fit go on to further
    tables, each led by the variant column again, so that no number is cut short."""
    header, rows = summary_rows(summaries, baseline)
    # a column takes its widest cell, one space either side and one border; the table, one more border
    widths = [max(len(cell) for cell in [name, *(row[i] for row in rows)]) + 3 for i, name in enumerate(header)]
    groups: list[list[int]] = [[]]
    for i in range(1, len(header)):
        if groups[-1] and 1 + widths[0] + sum(widths[j] for j in groups[-1]) + widths[i] > width:
            groups.append([])
        groups[-1].append(i)
    tables = []
    for group in groups:
        table = Table(title=title if not tables else None)
        for i in [0, *group]:
            table.add_column(header[i], justify="left" if i == 0 else "right", no_wrap=True)
        for row in rows:
            table.add_row(*(row[i] for i in [0, *group]))
        tables.append(table)
    return tables


def markdown(runs: list[RunResult], summaries: list[VariantSummary], baseline: str, plots: list[Path]) -> str:
    """The whole `report.md`: summary, variants, every run, continued runs' starting losses, plots."""
    seeds = sorted({r.seed for r in runs})
    lines = [
        "# Study report",
        "",
        f"{len(runs)} finished runs of {len(summaries)} variants, seeds {', '.join(map(str, seeds))}. Baseline:"
        f" `{baseline}`. Validation loss is the last logged `val/loss` of each run; `± ` is the sample standard"
        f" deviation over seeds; the gap to `{baseline}` is paired by seed (same seed, same data order). Bits per"
        " byte (`val/bpb`) divide the same validation's loss by the UTF-8 bytes its tokens stand for, so runs with"
        " different tokenizers compare. Speed and"
        " memory are ratios of the means (tokens/s: median of the rolling averages logged in the second half of a"
        " run; memory: peak allocated).",
        *shared_note(runs),
        *suspect_note(runs),
        "",
        "## Summary",
        "",
        *markdown_table(*summary_rows(summaries, baseline)),
        "",
        "## Variants",
        "",
        *markdown_table(["variant", "definition"], [[s.variant, f"`{s.definition}`"] for s in summaries], 2),
        "",
        "## Runs",
        "",
    ]
    header = ["variant", "seed", "steps", "tokens", "val loss", "at step", "train loss (last 10%)", "tokens/s"]
    cells = [
        [
            r.variant,
            str(r.seed),
            str(r.steps),
            f"{r.tokens:,}",
            f"{r.val_loss:.4f}",
            str(r.val_step),
            num(train_tail(r), ".4f"),
            num(r.tokens_per_sec, ",.0f"),
        ]
        for r in runs
    ]
    lines += markdown_table(header, cells)
    lines += downstream_section(summaries)
    if any(s.initial_val_loss is not None for s in summaries):
        lines += [
            "",
            "## Starting point of continued runs",
            "",
            f"Validation loss of each variant's starting weights (`mhar validate`), and the largest per-seed"
            f" difference to `{baseline}`'s: a function-preserving conversion gives 0.",
            "",
        ]
        rows = [
            [s.variant, pm(s.initial_val_loss, None, 6), pm(s.initial_gap, None, 6, sign=True), pm(s.val_loss, None)]
            for s in summaries
        ]
        lines += markdown_table(["variant", "start val loss", f"vs {baseline}", "final val loss"], rows)
    lines += cost_note(runs, summaries, baseline)
    lines += environment_note(runs)
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


def cost_note(runs: list[RunResult], summaries: list[VariantSummary], baseline: str) -> list[str]:
    """The gap at equal GPU time and the baseline compute that reaches each variant's loss (`study.cost`), paired by
    seed; nothing without baseline runs of the variants' seeds."""
    base = {r.seed: r for r in runs if r.variant == baseline}
    rows = []
    for summary in summaries:
        paired = [r for r in runs if r.variant == summary.variant != baseline and r.seed in base]
        if not paired:
            continue
        costs = [cost.cost(r, base[r.seed], summary.speed_ratio) for r in paired]
        equal_time = [c.equal_time_gap for c in costs if c.equal_time_gap is not None]
        multipliers = [c.compute_multiplier for c in costs if c.compute_multiplier is not None]
        rows.append(
            [
                summary.variant,
                num(summary.speed_ratio, ".2f") + ("x" if finite(summary.speed_ratio) else ""),
                pm(*mean_sd([c.gap for c in costs]), sign=True),
                pm(*mean_sd(equal_time), sign=True) if equal_time else "-",
                pm(*mean_sd(multipliers), digits=2) + "x" if len(multipliers) == len(costs) else "-",
            ]
        )
    if not rows:
        return []
    header = ["variant", "speed", f"vs {baseline}", "at equal GPU time", f"{baseline} compute to match"]
    return [
        "",
        "## Cost",
        "",
        f"Gap at equal GPU time: the variant's final loss minus {baseline}'s after the tokens {baseline} trains in the"
        f" same time (the variant's tokens / its speed ratio, measured alone). {baseline} compute to match: the tokens"
        f" after which {baseline}'s validation curve reaches the variant's final loss, over the variant's tokens"
        f" (above 1x the variant is worth more {baseline} compute than it used). Both read {baseline}'s curve of the"
        " same seed, interpolated in log tokens, and past its end a power law fitted to its second half; a point"
        " inside one cosine schedule is not a shorter run's final loss, so inside the curve both understate the"
        f" variant's advantage. `-`: no speed measured alone, or {baseline} never reaches the loss.",
        "",
        *markdown_table(header, rows),
    ]


def downstream_section(summaries: list[VariantSummary]) -> list[str]:
    """A table of each variant's mean accuracy per downstream task at the last validation (nothing if none logged)."""
    tasks = sorted({task for s in summaries for task in s.downstream})
    if not tasks:
        return []
    rows = [[s.variant, *(pm(*s.downstream.get(task, (None, None)), digits=3) for task in tasks)] for s in summaries]
    return [
        "",
        "## Downstream accuracy",
        "",
        "Accuracy per task at each run's last validation (`downstream/<task>/acc`, length-normalised log-likelihood"
        " of the choices), mean `±` standard deviation over seeds.",
        "",
        *markdown_table(["variant", *tasks], rows),
    ]


def environment_note(runs: list[RunResult]) -> list[str]:
    """A table of the devices and versions the runs trained with, one row per combination (nothing if no run
    recorded one): runs compared across rows may differ by more than their variant."""
    if not any(r.environment for r in runs):
        return []
    keys = ["device", "world_size", *PACKAGES, "source", "python"]
    groups: dict[tuple[str, ...], list[RunResult]] = {}
    for run in runs:
        row = tuple("-" if run.environment.get(k) is None else str(run.environment[k]) for k in keys)
        groups.setdefault(row, []).append(run)
    rows = []
    for row, members in groups.items():
        dates = sorted(str(r.environment["started"])[:10] for r in members if r.environment.get("started"))
        names = ", ".join(f"{r.variant} {r.seed}" for r in members)
        rows.append([*row, f"{dates[0]} - {dates[-1]}" if dates else "-", names])
    header = ["device", "ranks", *PACKAGES, "kit source", "python", "started", "runs (variant seed)"]
    return ["", "## Environment", "", *markdown_table(header, rows, len(header))]


def suspect_note(runs: list[RunResult]) -> list[str]:
    """The `suspect_runs` as a list under a heading (nothing if there are none)."""
    suspects = suspect_runs(runs)
    return ["", "Runs to check:", "", *(f"- {line}" for line in suspects)] if suspects else []


def shared_note(runs: list[RunResult]) -> list[str]:
    """A line saying which runs shared their machine, whose speed the report therefore does not compare."""
    shared = sorted({r.shared for r in runs if r.shared > 1})
    if not shared:
        return []
    return [
        "",
        f"Runs trained {' or '.join(map(str, shared))} at a time (`--jobs`) shared their machine: their tokens/s are"
        " not their own speed, and the summary's tokens/s and speed ratios leave them out.",
    ]


def write(
    study: Path, runs: list[RunResult], summaries: list[VariantSummary], baseline: str, plots: list[Path]
) -> Path:
    """Write `report.md` and `results.json` into `study`; return the report's path."""
    data = {"baseline": baseline, "variants": [asdict(s) for s in summaries], "runs": [asdict(r) for r in runs]}
    (study / "results.json").write_text(json.dumps(data, indent=1) + "\n")
    path = study / "report.md"
    path.write_text(markdown(runs, summaries, baseline, plots))
    return path
