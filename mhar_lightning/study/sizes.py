"""The gap to the baseline against model size: the same variants trained in several studies (one model size each),
each gap paired by seed within its study, drawn against the baseline's parameter count."""

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure

from mhar_lightning.study.results import RunResult

DPI = 80


@dataclass(frozen=True)
class SizeGap:
    """One variant in one study: the baseline's parameters and the paired gaps, seed by seed."""

    study: str
    variant: str
    params: int
    tokens: int
    gaps: dict[int, float]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.gaps.values())

    @property
    def sd(self) -> float | None:
        return statistics.stdev(self.gaps.values()) if len(self.gaps) > 1 else None


def read_study(study: Path) -> tuple[str, list[RunResult]]:
    """(baseline, finished runs) of a study folder, from the `results.json` its report wrote."""
    path = study / "results.json"
    if not path.is_file():
        raise ValueError(f"{path} does not exist: run `mhar compare --report-only {study}` first")
    data = json.loads(path.read_text())
    runs = []
    for run in data["runs"]:
        for curve in ("val_curve", "train_curve"):
            run[curve] = [(int(s), float(v)) for s, v in run[curve]]
        runs.append(RunResult(**run))
    return data["baseline"], runs


def size_gaps(studies: list[Path]) -> list[SizeGap]:
    """Every variant of every study that shares a seed with its baseline, in study order."""
    gaps = []
    for study in studies:
        baseline, runs = read_study(study)
        base = {r.seed: r for r in runs if r.variant == baseline}
        if not base:
            raise ValueError(f"{study} has no finished run of its baseline {baseline!r}")
        params = next(iter(base.values())).params
        by_variant: dict[str, dict[int, float]] = {}
        for run in runs:
            if run.variant != baseline and run.seed in base:
                by_variant.setdefault(run.variant, {})[run.seed] = run.val_loss - base[run.seed].val_loss
        tokens = next(iter(base.values())).tokens
        gaps += [SizeGap(study.name, v, params, tokens, dict(sorted(g.items()))) for v, g in by_variant.items()]
    return gaps


def markdown(gaps: list[SizeGap]) -> str:
    """A table: one row per variant, one column per study (mean ± sd of the paired gap, and the seeds)."""
    studies = list(dict.fromkeys(g.study for g in gaps))
    params = {g.study: g.params for g in gaps}
    header = ["variant", *(f"{s} ({params[s] / 1e6:.1f} M)" for s in studies)]
    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * len(studies)]
    cells = {(g.variant, g.study): g for g in gaps}
    for variant in dict.fromkeys(g.variant for g in gaps):
        row = [variant]
        for study in studies:
            gap = cells.get((variant, study))
            if gap is None:
                row.append("")
                continue
            spread = f" ± {gap.sd:.4f}" if gap.sd is not None else ""
            row.append(f"{gap.mean:+.4f}{spread} ({len(gap.gaps)})")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def figure(gaps: list[SizeGap], baseline: str = "sum") -> Figure:
    """Paired gap against the baseline's parameters (log scale): each seed a dot, the mean a line, per variant."""
    fig = Figure(figsize=(6.5, 4.2), dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    for variant in dict.fromkeys(g.variant for g in gaps):
        points = sorted((g for g in gaps if g.variant == variant), key=lambda g: g.params)
        (line,) = ax.plot([g.params for g in points], [g.mean for g in points], marker="o", label=variant)
        for g in points:
            ax.scatter([g.params] * len(g.gaps), list(g.gaps.values()), color=line.get_color(), s=12, alpha=0.5)
    ax.axhline(0.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel(f"parameters ({baseline})")
    ax.set_ylabel(f"final validation loss - {baseline}'s (same seed)")
    ax.set_title("Gap to the baseline against model size (dots: seeds; line: mean)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig
