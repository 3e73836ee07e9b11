"""The study grid: variants (recipes or residual strategies) x seeds, each run a real `mhar fit` in its own folder."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import yaml

from mhar_lightning.recipes import recipe_chain
from mhar_lightning.residual import RESIDUALS

RESULT_FILE = "result.json"
ARGS_FILE = "args.json"
LOG_FILE = "fit.log"
SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class Variant:
    """One arm of a study: a recipe and, unless the recipe sets it, a residual strategy to put on it.

    `residual` is what `--model.residual` takes: a registered name (`sum`) or a `{class_path, init_args}` mapping.
    """

    name: str
    recipe: Path
    residual: str | dict[str, Any] | None = None

    def fit_args(self) -> list[str]:
        args = ["--config", str(self.recipe)]
        if self.residual is not None:
            value = self.residual if isinstance(self.residual, str) else json.dumps(self.residual)
            args += ["--model.residual", value]
        return args

    def describe(self) -> str:
        """The variant's definition in one line: recipe, then the residual it sets."""
        recipe = recipe_name(self.recipe)
        if self.residual is None:
            return recipe
        return f"{recipe} + residual {self.residual if isinstance(self.residual, str) else json.dumps(self.residual)}"


def recipe_name(recipe: Path) -> str:
    """A recipe as a study records it: from its innermost `recipes/` folder on (`recipes/study/6m.yaml`), so a
    study resumed from another checkout or directory is the same study; any other recipe by its path from here."""
    path = recipe.resolve()
    folders = path.parts[:-1]
    if "recipes" in folders:
        first = len(folders) - 1 - folders[::-1].index("recipes")
        return str(Path(*path.parts[first:]))
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def trainer_settings(recipe: Path, overrides: Sequence[str]) -> dict[str, Any]:
    """The `trainer` keys a run's `mhar fit` gets from its recipe's chain and `--trainer.KEY value` overrides (the
    later wins, as jsonargparse merges them): a run's settings checked before it trains. Unset keys are absent."""
    settings: dict[str, Any] = {}
    for path in recipe_chain(recipe):
        settings.update((yaml.safe_load(path.read_text()) or {}).get("trainer") or {})
    words = iter(overrides)
    for word in words:  # `--section.key value` or `--section.key=value`, as `mhar compare` split them
        flag, eq, value = word.partition("=")
        value = value if eq else next(words, "")
        key = flag.removeprefix("--trainer.")
        if flag.startswith("--trainer.") and key.isidentifier():
            settings[key] = yaml.safe_load(value)
    return settings


def parse_variant(text: str, recipe: Path, strategies: Mapping[str, dict[str, Any] | str]) -> Variant:
    """`[NAME=]SPEC`: SPEC is a recipe (`.yaml`), a strategy of `strategies`, a registered residual name or a
    class path, the last two optionally with arguments (`mhar_lightning.residual.MHAR:heads=2,blocks=8`)."""
    name, eq, spec = text.partition("=")
    if not eq or ":" in name or ("/" in name and spec.endswith((".yaml", ".yml"))):  # a path may hold a '='
        name, spec = "", text
    elif SAFE_NAME.search(name) or name in ("", ".", ".."):
        raise ValueError(
            f"variant name {name!r} in {text!r} is not a plain name: use letters, digits, '.', '_' and '-' (not '.' or"
            " '..' alone), e.g. mhar-h2=mhar:heads=2"
        )
    if spec.endswith((".yaml", ".yml")):
        path = Path(spec)
        if not path.is_file():
            raise ValueError(f"recipe {spec} does not exist: pass a recipe file, a strategy name or a class path")
        return Variant(safe_name(name or path.stem), path)
    if spec in strategies:
        return Variant(safe_name(name or spec), recipe, strategies[spec])
    target, colon, arg_text = spec.partition(":")
    if "." not in target and target not in RESIDUALS:
        known = ", ".join([*strategies, *(n for n in sorted(RESIDUALS) if n not in strategies)])
        raise ValueError(f"unknown variant {spec!r}: use a recipe (.yaml), one of {known}, or a class path")
    if not colon:
        residual: str | dict[str, Any] = target if target in RESIDUALS else {"class_path": target}
        return Variant(safe_name(name or spec), recipe, residual)
    class_path = target if "." in target else f"{RESIDUALS[target].__module__}.{RESIDUALS[target].__qualname__}"
    init_args = {}
    for item in filter(None, arg_text.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"variant {spec!r}: write arguments as key=value, e.g. {target}:heads=4,blocks=8")
        init_args[key] = yaml.safe_load(value)
    return Variant(safe_name(name or spec), recipe, {"class_path": class_path, "init_args": init_args})


def safe_name(text: str) -> str:
    """A folder name for a variant."""
    return SAFE_NAME.sub("_", text).strip("_") or "variant"


@dataclass
class Run:
    """One (variant, seed) cell of the grid, trained in `dir` (the run's `trainer.default_root_dir`)."""

    variant: Variant
    seed: int
    dir: Path
    overrides: Sequence[str] = ()
    init_from: Path | None = None

    @property
    def finished(self) -> bool:
        """Whether the run has a result that reached its `trainer.max_steps` (a run stopped early resumes)."""
        path = self.dir / RESULT_FILE
        if not path.is_file():
            return False
        max_steps = trainer_settings(self.variant.recipe, self.overrides).get("max_steps") or 0
        return json.loads(path.read_text())["steps"] >= max_steps

    def check_final_validation(self) -> None:
        """Refuse, before any training, a run that would end without validating its final weights: the report's
        validation loss is the loss of the last step."""
        trainer = trainer_settings(self.variant.recipe, self.overrides)
        steps, interval = trainer.get("max_steps"), trainer.get("val_check_interval")
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"{self.variant.name}: trainer.max_steps={steps}: set --trainer.max_steps N (N >= 1)")
        if trainer.get("limit_val_batches") == 0:
            raise ValueError(f"{self.variant.name}: trainer.limit_val_batches=0 validates nothing: remove it")
        accumulate = trainer.get("accumulate_grad_batches") or 1
        if not isinstance(interval, int) or (steps * accumulate) % interval:
            counted = f"trainer.max_steps={steps}"
            if accumulate > 1:  # the interval counts batches
                counted += f" x accumulate_grad_batches={accumulate}"
            raise ValueError(
                f"{self.variant.name}: trainer.val_check_interval={interval} does not divide {counted}, so the run "
                f"would not validate its final weights: pass --trainer.val_check_interval N, N a divisor of "
                f"{steps * accumulate}"
            )

    def check_arguments(self) -> None:
        """Record the run's definition on its first start; refuse to skip or resume a run started differently."""
        path = self.dir / ARGS_FILE
        current = {"variant": self.variant.describe(), "overrides": list(self.overrides), "seed": self.seed}
        if not path.is_file():
            self.dir.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(current, indent=1) + "\n")
        elif (recorded := json.loads(path.read_text())) != current:
            raise ValueError(
                f"{self.dir} was started as {recorded}, not as {current}: pass another --out, or delete the folder"
            )

    @property
    def last_checkpoint(self) -> Path:
        return self.dir / "checkpoints" / "last.ckpt"

    def base_args(self) -> list[str]:
        """Config of this run shared by `mhar fit` and `mhar validate`: recipe, residual, overrides, seed, folder."""
        args = [*self.variant.fit_args(), *self.overrides, "--seed_everything", str(self.seed)]
        if self.init_from is not None:
            args += ["--model.init_from", str(self.init_from)]
        return args

    def fit_args(self) -> list[str]:
        args = ["fit", *self.base_args(), "--trainer.default_root_dir", str(self.dir)]
        args += ["--trainer.enable_progress_bar", "false"]
        if self.last_checkpoint.is_file():
            args += ["--ckpt_path", "last"]
        return args


def run_dir(study: Path, variant: str, seed: int) -> Path:
    return study / "runs" / variant / f"seed{seed}"


class Children:
    """The `mhar` processes a study is running, so that a SIGTERM to the runner (a job's time limit) ends them too.

    Inside `Children.on_sigterm()` the signal kills every child, then leaves the runner by `SystemExit`; the interrupted
    runs resume from their `last.ckpt` on the next call.
    """

    def __init__(self) -> None:
        self._running: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self.stopped = False  # set by `kill_all`: the runner is ending, so no run may be retried

    def run(self, cmd: list[str], out: IO[str]) -> int:
        """Run `cmd` to its end (killing it if this thread is interrupted) and return its exit status; once
        `kill_all` has run, start nothing and return -SIGKILL."""
        # PYTHONSAFEPATH: the installed kit, never a same-named folder in the working directory (a source checkout)
        env = {**os.environ, "PYTHONSAFEPATH": "1"}
        with self._lock:
            if self.stopped:
                return -signal.SIGKILL
            process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
            self._running.add(process)
        try:
            return process.wait()
        finally:
            with self._lock:
                self._running.discard(process)
            if process.poll() is None:
                process.kill()
                process.wait()

    def kill_all(self) -> None:
        with self._lock:
            self.stopped = True
            for process in self._running:
                process.kill()

    @contextlib.contextmanager
    def on_sigterm(self) -> Iterator[None]:
        """Within: SIGTERM kills the children and raises `SystemExit` in the main thread (call it from there)."""

        def stop(signum: int, frame: object) -> None:
            self.kill_all()
            raise SystemExit(128 + signum)

        previous = signal.signal(signal.SIGTERM, stop)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)


CHILDREN = Children()


def mhar(args: list[str], log: Path) -> None:
    """`mhar ARGS` in a fresh Python process, its output appended to `log`; on failure raise with the log's tail."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as out:
        out.write(f"$ mhar {' '.join(args)}\n")
        out.flush()
        returncode = CHILDREN.run([sys.executable, "-m", "mhar_lightning.cli", *args], out)
    if returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise RuntimeError(f"`mhar {args[0]}` failed (exit {returncode}); the end of {log}:\n{tail}")
