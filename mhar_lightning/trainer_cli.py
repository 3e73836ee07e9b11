"""`MharCLI`: the `mhar` subcommands that run the Trainer (fit, validate, test), built on `LightningCLI`, with the
kit's recipes, checks and defaults."""

import difflib
import importlib
import inspect
import os
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NoReturn

import torch
import yaml
from jsonargparse import ArgumentParser
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelSummary, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException

from mhar_lightning.arguments import closest_option
from mhar_lightning.callbacks import FinalStepCheckpoint, ParameterSummary, RunSummary, StepProgressBar
from mhar_lightning.checkpoint.atomic_write import AtomicCheckpointIO, remove_stale_temporaries
from mhar_lightning.checkpoint.finite import check_finite_optimizer
from mhar_lightning.checkpoint.read_file import read_checkpoint
from mhar_lightning.checkpoint.read_sharded import check_sharded_checkpoint, is_sharded_checkpoint
from mhar_lightning.checkpoint.resume_args import check_same_model, runtime_overrides
from mhar_lightning.config import VOCAB_MULTIPLE, check_fields, padded_vocab
from mhar_lightning.convert import check_data_tokenizer
from mhar_lightning.data import ShardIndex, TokenDataModule
from mhar_lightning.data.shards import INDEX_FILE
from mhar_lightning.errors import ConfigError
from mhar_lightning.module import LanguageModel
from mhar_lightning.preflight import check_output_dir, checkpoint_bytes
from mhar_lightning.recipes import read_recipe, recipe_chain
from mhar_lightning.residual import RESIDUALS
from mhar_lightning.residual.trust import allow_class_path, check_stored_residual
from mhar_lightning.run_environment import SaveRunConfig
from mhar_lightning.run_folder import RunLock, check_fresh_run, last_checkpoint
from mhar_lightning.terminal import HeldStartupLines
from mhar_lightning.tools import TOOLS
from mhar_lightning.user_modules import allow_user_module

FLOAT32_MATMUL_PRECISION = "high"
"""fp32 matmuls on GPUs may use TF32 (as LitGPT's and torchtitan's training scripts set): the recipes compute in bf16,
so this touches only what stays in fp32 (a `32-true` run, evaluation in fp32), and Lightning's tip about it is gone."""
BAD_VALUE = re.compile(r'^Parser key "([^"]+)":\n')
GIVEN_VALUE = re.compile(r"^  Given value: (.*)$", re.MULTILINE)  # a union's value, before its subtypes' reasons
GOT_VALUE = re.compile(r"Got value: (.*)$", re.MULTILINE)
EXPECTED_TYPE = re.compile(r"Expected a (?:<class '(\w+)'>|typing\.Literal\[(.*)\])")
TYPE_NAMES = {"int": "an integer", "float": "a number", "bool": "true/false", "str": "a string", "NoneType": "null"}


class MharArgumentParser(LightningArgumentParser):
    """Lightning's parser, with a one-line error instead of a usage dump; an unknown option names the closest one."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if self.exit_on_error:  # inner parsers raise, and catch, their own errors
            parser = getattr(ex, "subcommand_parser", None) or self
            raise ConfigError(bad_value_line(message.strip()) + closest_option(parser, message))
        super().error(message, ex)


def bad_value_line(message: str) -> str:
    """jsonargparse's several-line report of a value of the wrong type as one line: the flag, the value given and
    what the flag takes (other messages with their lines joined)."""
    key, given = BAD_VALUE.match(message), GIVEN_VALUE.search(message) or GOT_VALUE.search(message)
    reasons = [line.strip()[2:] for line in message.splitlines() if line.strip().startswith("- ")]
    others = [reason.partition(". Got value")[0] for reason in reasons if not reason.startswith("Expected a ")]
    expected = [
        TYPE_NAMES.get(name, name) if name else f"one of {literal}" for name, literal in EXPECTED_TYPE.findall(message)
    ]
    if key is None or given is None or not (others or expected):
        return " ".join(line.strip() for line in message.splitlines())
    flag, value = key.group(1), given.group(1)
    if others:  # a class-typed or path-typed setting: its own reason says more than a list of types
        reason = next((other for other in others if other.startswith("Not a valid")), others[0])
        return f"--{flag} {value!r}: {reason}; fix the flag, or {flag} in the config"
    expected = list(dict.fromkeys(expected))
    takes = expected[0] if len(expected) == 1 else f"{', '.join(expected[:-1])} or {expected[-1]}"
    return f"--{flag} {value!r}: expected {takes}; fix the flag, or {flag} in the config"


class MharCLI(LightningCLI):
    """`LightningCLI` for `LanguageModel` + `TokenDataModule` with the kit's trainer defaults and argument links.

    Sequence length and vocabulary are set once, on the data (`data.seq_len`, `data.tokenizer`), and copied to
    the model. Checkpoints go to `<default_root_dir>/checkpoints` (so `--ckpt_path last` finds them across
    runs), TensorBoard logs to `<default_root_dir>/tensorboard`, and checkpoint files are written atomically.
    `fit` holds a lock on its checkpoint folder while it runs (`run_folder`).
    """

    def __init__(self, args: Sequence[str] | None = None, run: bool = True) -> None:
        self.run_lock: RunLock | None = None  # `fit` takes it before touching its checkpoint folder
        if torch.cuda.is_available():
            torch.set_float32_matmul_precision(FLOAT32_MATMUL_PRECISION)
        self.startup_lines = HeldStartupLines()
        try:
            with self.startup_lines:
                super().__init__(
                    LanguageModel,
                    TokenDataModule,
                    trainer_defaults={
                        "use_distributed_sampler": False,
                        "precision": "bf16-mixed" if torch.cuda.is_available() else "32-true",
                    },
                    seed_everything_default=0,
                    parser_class=MharArgumentParser,
                    save_config_callback=SaveRunConfig,
                    save_config_kwargs={"overwrite": True},
                    auto_configure_optimizers=False,
                    args=args,
                    run=run,
                )
        finally:  # however the run ends: done, refused, failed or stopped by SIGTERM
            if self.run_lock is not None:
                self.run_lock.release()

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        """Parse, first putting each recipe's `# base:` chain in front of it (see `with_recipe_bases`)."""
        if isinstance(args, (list, tuple)) or args is None:
            args = sys.argv[1:] if args is None else list(args)
            for flag in (arg.partition("=")[0] for arg in args):
                if flag in ("--model.vocab_size", "--model.seq_len"):
                    raise ConfigError(linked_field_error(flag.removeprefix("--model.")))
            for class_path in user_class_paths(with_recipe_bases(args)):
                allow_user_module(class_path)
            check_class_paths(args)
            try:
                self.config = parser.parse_args(with_recipe_bases(args))
            except (ImportError, AttributeError, ValueError) as error:
                if not failed_class_path_import(error):
                    raise
                undotted = re.fullmatch(r"Expected a dot import path string: (\S+)", str(error))
                if undotted:  # a recipe's `class_path: mhar`
                    raise ConfigError(f"class_path {undotted.group(1)}: {undotted_class_path_fix(undotted.group(1))}")
                raise ConfigError(
                    f"a class_path in the config cannot be imported ({error}): check its spelling, install the package"
                    " that provides it or add its directory to PYTHONPATH"
                ) from None
            if self.config.get(str(self.config.get("subcommand")), {}).get("ckpt_path"):  # what the user set, alone
                self.given = parser.parse_args(with_recipe_bases(args), defaults=False)
        else:
            super().parse_arguments(parser, args)
        config = self.config.get(str(self.config.get("subcommand")), self.config)
        check_linked_fields(config)
        allow_user_residual(config.model.get("residual"))

    def _parse_ckpt_path(self) -> None:
        """Resolve `--ckpt_path last`, refuse given model arguments that contradict the checkpoint, then take the
        checkpoint's model arguments (Lightning's behaviour, without the shape a run records beside them) except the
        runtime ones the user set."""
        subcommand = self.config.get("subcommand")
        config = self.config.get(str(subcommand))
        if not subcommand or not config.get("ckpt_path"):
            return
        dirpath = config.checkpoint.dirpath or str(Path(config.trainer.default_root_dir or os.getcwd()) / "checkpoints")
        path = checkpoint_file(config.ckpt_path, dirpath)
        if path is None or not Path(path).is_file():
            return
        config.ckpt_path = path
        given = getattr(self, "given", None)
        given_model = given.get(f"{subcommand}.model") if given is not None else None
        checkpoint = read_checkpoint(path)  # verified: the first read of the file
        if subcommand == "fit":
            check_finite_optimizer(checkpoint, path)  # resuming applies it to every later step
        hparams = checkpoint.get("hyper_parameters") or {}
        check_stored_residual(hparams.get("residual"), f"checkpoint {path}")
        given_model = given_model.as_dict() if given_model is not None else {}
        trained_data = checkpoint.get("datamodule_hyper_parameters") or {}
        tokenizers = (config.data.get("tokenizer"), trained_data.get("tokenizer"))
        check_same_model(given_model, config.model.as_dict(), hparams, path, tokenizers, training=subcommand == "fit")
        keep = runtime_overrides(given_model, config.model.as_dict(), hparams, path, training=subcommand == "fit")
        arguments = inspect.signature(LanguageModel.__init__).parameters  # not what the run records beside them
        model = {name: value for name, value in hparams.items() if name in arguments and name != "self"}
        if model:
            self.config = self.parser.parse_object({subcommand: {"model": model}}, self.config)
        for field, value in keep.items():
            self.config[subcommand].model[field] = value

    def _run_subcommand(self, subcommand: str) -> None:
        """Run it; a run stopped by SIGTERM says, in the exception `mhar` prints, which checkpoint holds its step."""
        self.startup_lines.end()  # set up without a refusal: the run starts
        try:
            super()._run_subcommand(subcommand)
        except SIGTERMException as stop:
            raise SIGTERMException(sigterm_report(self.trainer)) from stop

    def init_parser(self, **kwargs) -> LightningArgumentParser:
        kwargs.setdefault("allow_abbrev", False)  # a typo such as --trainer.max_step fails instead of matching
        return super().init_parser(**kwargs)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {name: skip for name, skip in LightningCLI.subcommands().items() if name != "predict"}

    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs) -> None:
        """Also list the tools in `mhar --help` (they are dispatched by `main` before parsing)."""
        super()._add_subcommands(parser, **kwargs)
        for name, (_, _, help_text) in TOOLS.items():
            parser._subcommands_action.add_subcommand(name, ArgumentParser(description=help_text), help=help_text)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(FinalStepCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.save_last": True, "checkpoint.enable_version_counter": False})
        parser.link_arguments("data.seq_len", "model.seq_len")
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")

    @property
    def run_config(self):
        """The parsed config of the running subcommand (the whole config when run=False)."""
        return self.config.get(str(self.subcommand), self.config)

    def before_instantiate_classes(self) -> None:
        if self.run_config.checkpoint.dirpath is None:
            self.run_config.checkpoint.dirpath = str(Path(self.root_dir) / "checkpoints")

    def instantiate_classes(self) -> None:
        """Build model, data and trainer; an argument they refuse (ValueError) becomes a one-line config error."""
        try:
            super().instantiate_classes()
        except ConfigError:
            raise
        except (ValueError, MisconfigurationException) as error:
            raise ConfigError(one_line(str(error))) from error

    def after_instantiate_classes(self) -> None:
        """Refuse, before any step, what would fail later: settings, data, checkpoint and output folders."""
        config = self.run_config
        try:
            if self.subcommand == "fit":
                self.model.check_strategy(self.trainer)
        except ValueError as error:
            raise ConfigError(str(error)) from error
        ckpt_path = checkpoint_file(config.get("ckpt_path"), config.checkpoint.dirpath)
        if self.subcommand == "test":
            raise ConfigError(
                "prepared data has train and val splits only, so there is no test set: use `mhar validate` with the"
                " same arguments"
            )
        if self.subcommand == "validate" and ckpt_path is None and self.model.init_from is None:
            raise ConfigError(
                "mhar validate needs trained weights: pass --ckpt_path (a .ckpt, or last) or --model.init_from"
            )
        if self.subcommand == "fit" and not 0 < self.trainer.max_steps:
            raise ConfigError(
                f"trainer.max_steps={self.trainer.max_steps}: set --trainer.max_steps N (N >= 1); the learning-rate"
                " schedule is defined over optimizer steps"
            )
        if self.subcommand == "fit" and not 0 < self.trainer.accumulate_grad_batches:
            raise ConfigError(
                f"trainer.accumulate_grad_batches={self.trainer.accumulate_grad_batches}: set"
                " --trainer.accumulate_grad_batches N (N >= 1 batches per optimizer step)"
            )
        if self.subcommand is not None:  # a run, not a config being inspected (run=False)
            self.datamodule.check(self.trainer.world_size, validate=self.trainer.limit_val_batches > 0)
        if is_sharded_checkpoint(ckpt_path):
            # before Lightning unpickles anything from it; rank 0 alone hashes it (its refusal stops the launch)
            check_sharded_checkpoint(ckpt_path, verify=self.trainer.global_rank == 0)
            if not isinstance(self.trainer.strategy, ModelParallelStrategy):
                raise ConfigError(
                    f"--ckpt_path {ckpt_path} is a sharded checkpoint, which only ModelParallelStrategy reads: run with"
                    " --trainer.strategy lightning.pytorch.strategies.ModelParallelStrategy on the devices that wrote"
                    f" it, or merge it with `mhar consolidate {ckpt_path} OUT.ckpt` and pass OUT.ckpt"
                )
        check_checkpoint_vocab(ckpt_path, config.checkpoint.dirpath, self.datamodule)
        check_data(self.model, self.datamodule)
        if self.subcommand == "fit":
            check_output_dir(self.root_dir, "trainer.default_root_dir")
            saves = config.checkpoint.save_top_k != 0 or config.checkpoint.save_last
            needed = checkpoint_bytes(self.model.model_config) if saves else 0
            check_output_dir(config.checkpoint.dirpath, "checkpoint.dirpath", needed)
            if rank_zero_only.rank == 0:  # other ranks run under rank 0, which holds the lock
                self.run_lock = RunLock(config.checkpoint.dirpath)
                self.run_lock.acquire()
            check_fresh_run(config.checkpoint.dirpath, ckpt_path)
            remove_stale_temporaries(config.checkpoint.dirpath)

    @property
    def root_dir(self) -> str:
        return self.run_config.trainer.default_root_dir or os.getcwd()

    def instantiate_trainer(self, **kwargs) -> Trainer:
        """Add the TensorBoard logger, the atomic checkpoint writer, a progress bar that does not stall the GPU every
        step and a one-line parameter summary, unless the config sets its own, and the closing line of a run."""
        trainer_config = self._get(self.config_init, "trainer", default={})
        if trainer_config.get("logger") in (None, True):
            kwargs["logger"] = TensorBoardLogger(self.root_dir, name="tensorboard")
        callbacks = trainer_config.get("callbacks") or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        added = []
        if trainer_config.get("enable_progress_bar") is not False and not any(
            isinstance(callback, ProgressBar) for callback in callbacks
        ):
            added.append(StepProgressBar())
        if trainer_config.get("enable_model_summary") is not False and not any(
            isinstance(callback, ModelSummary) for callback in callbacks
        ):
            added.append(ParameterSummary())
            kwargs["enable_model_summary"] = False  # Lightning would print its own table as well
        kwargs["callbacks"] = [*callbacks, *added, RunSummary()]  # after the bar, which stops drawing first
        plugins = trainer_config.get("plugins") or []
        plugins = plugins if isinstance(plugins, list) else [plugins]
        if not any(isinstance(plugin, CheckpointIO) for plugin in plugins):
            kwargs["plugins"] = [*plugins, AtomicCheckpointIO()]
        return super().instantiate_trainer(**kwargs)


def sigterm_report(trainer: Trainer) -> str:
    """Where a run stopped by SIGTERM stopped, and which checkpoint it can resume from."""
    callback = trainer.checkpoint_callback
    path = getattr(callback, "last_model_path", "") or getattr(callback, "best_model_path", "")
    saved = getattr(callback, "_last_global_step_saved", None)  # Lightning's record of the step it last saved
    if not path:
        return f"stopped by SIGTERM at step {trainer.global_step}, with no checkpoint saved"
    at = f" (step {saved})" if saved is not None and saved != trainer.global_step else ""
    return f"stopped by SIGTERM at step {trainer.global_step}; checkpoint {path}{at}"


def check_linked_fields(config) -> None:
    """Refuse model fields that the data sets, and unknown ones (checked on the user's config, before a checkpoint's
    are merged)."""
    if config.model.get("vocab_size") is not None:
        raise ConfigError(linked_field_error("vocab_size", config.model.vocab_size))
    overrides = config.model.get("model_overrides") or {}
    for field in ("vocab_size", "max_seq_len"):
        if field in overrides:
            raise ConfigError(linked_field_error(f"model_overrides.{field}", overrides[field]))
    try:
        check_fields(overrides, "model.model_overrides")
    except ValueError as error:
        raise ConfigError(str(error)) from None


def allow_user_residual(residual: object) -> None:
    """Let checkpoints name the residual class the user's config names (a flag or a recipe), as `class_path` or as
    `--model.residual package.Class`."""
    class_path = residual.get("class_path") if hasattr(residual, "get") else residual
    if isinstance(class_path, str) and "." in class_path:
        allow_class_path(class_path)


def failed_class_path_import(error: BaseException) -> bool:
    """Whether `error` was raised by jsonargparse importing a config's `class_path` (not by a bug elsewhere)."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_name == "import_object"


def linked_field_error(field: str, value: object = None) -> str:
    """One line saying that a model field comes from the data config, and what to set instead."""
    given = "" if value is None else f"={value}"
    if "vocab_size" in field:
        return (
            f"model.{field}{given} cannot be set: the vocabulary comes from data.tokenizer (rounded up to a multiple "
            f"of {VOCAB_MULTIPLE}) or from model.init_from; remove it and choose the tokenizer with --data.tokenizer"
        )
    return (
        f"model.{field}{given} cannot be set: the sequence length comes from data.seq_len;"
        " remove it and set --data.seq_len"
    )


def with_recipe_bases(args: list[str]) -> list[str]:
    """Expand every `--config recipe.yaml` into `--config base.yaml ... --config recipe.yaml`.

    jsonargparse merges several `--config` files in order, so a recipe holds only what differs from its base.
    """
    expanded: list[str] = []
    items = iter(args)
    for arg in items:
        flag, eq, value = arg.partition("=")
        if flag not in ("-c", "--config"):
            expanded.append(arg)
            continue
        value = value if eq else next(items, "")
        if not Path(value).is_file():
            expanded.extend([flag, value])
            continue
        for path in recipe_chain(Path(value)):
            expanded.extend([flag, str(path)])
    return expanded


def checkpoint_file(ckpt_path: str | None, checkpoint_dir: str) -> str | None:
    """The checkpoint `ckpt_path` names: `last` is the `last.ckpt` of `checkpoint_dir` (None if none)."""
    if ckpt_path == "last":
        return last_checkpoint(checkpoint_dir)
    if ckpt_path not in (None, "best", "hpc", "registry") and not Path(ckpt_path).exists():
        raise ConfigError(f"checkpoint {ckpt_path} does not exist: pass an existing checkpoint, or --ckpt_path last")
    if ckpt_path is not None and Path(ckpt_path).is_dir() and not is_sharded_checkpoint(ckpt_path):
        raise ConfigError(f"{ckpt_path} is a folder, not a checkpoint: pass a .ckpt file, or --ckpt_path last")
    return ckpt_path


def check_checkpoint_vocab(ckpt_path: str | None, checkpoint_dir: str, datamodule: TokenDataModule) -> None:
    """Refuse a checkpoint whose vocabulary or rank file differs from the data's tokenizer (before any training)."""
    ckpt_path = checkpoint_file(ckpt_path, checkpoint_dir)
    if not ckpt_path or not Path(ckpt_path).is_file():
        return
    checkpoint = read_checkpoint(ckpt_path, verify=False)  # verified when `MharCLI._parse_ckpt_path` read it
    vocab = checkpoint.get("hyper_parameters", {}).get("vocab_size")
    trained_with = checkpoint.get("datamodule_hyper_parameters", {}).get(
        "tokenizer", "the tokenizer it was trained with"
    )
    # the tokenizer's vocabulary; checkpoints of earlier versions hold it rounded up (`padded_vocab`)
    if vocab is not None and vocab not in (datamodule.vocab_size, padded_vocab(datamodule.vocab_size)):
        raise ConfigError(
            f"checkpoint {ckpt_path} has a {vocab}-token vocabulary but data.tokenizer={datamodule.tokenizer_name!r} "
            f"has {datamodule.vocab_size} tokens: set --data.tokenizer {trained_with}"
        )
    state = checkpoint.get(type(datamodule).__qualname__) or {}
    datamodule.check_fingerprint(state.get("tokenizer_fingerprint"), f"checkpoint {ckpt_path}")


def check_class_paths(args: list[str]) -> None:
    """Refuse a class that cannot be imported, or a strategy's name given as its class, named by a
    `--<key>.class_path` flag or by a `class_path` in a flag's JSON or YAML value (jsonargparse crashes on both)."""
    for given, path in flag_class_paths(args):
        module, _, name = path.rpartition(".")
        # A short name elsewhere may be one of Lightning's (`EarlyStopping`), which jsonargparse resolves.
        if not module and (path in RESIDUALS or given.startswith("--model.residual")):
            raise ConfigError(f"{given}: {undotted_class_path_fix(path)}")
        if module and not importable(module, name):
            raise ConfigError(
                f"{given}: no class {name} in an importable module {module}; check the spelling, and run from the"
                f" folder that holds {module.partition('.')[0]} or add that folder to PYTHONPATH"
            )


def flag_values(args: list[str]) -> Iterator[tuple[str, str]]:
    """(flag, the value after it or after its `=`) for each argument."""
    for flag, value in zip(args, [*args[1:], ""]):
        flag, eq, inline = flag.partition("=")
        yield flag, inline if eq else value


def flag_class_paths(args: list[str]) -> Iterator[tuple[str, str]]:
    """(how it was given, class path) for each class that a `--<key>.class_path` flag or a flag's JSON or YAML value
    names."""
    for flag, value in flag_values(args):
        if flag.endswith(".class_path"):
            yield f"{flag} {value}", value
        elif flag.startswith("--") and value.lstrip().startswith(("{", "[")):
            try:
                paths = list(class_paths(yaml.safe_load(value)))
            except yaml.YAMLError:
                continue  # not valid JSON or YAML: jsonargparse reports the flag
            yield from ((f"{flag} class_path {path}", path) for path in paths)


def user_class_paths(args: list[str]) -> list[str]:
    """The dotted class paths the user names: in flags (`flag_class_paths`, `--model.residual package.Class`) and
    in the `--config` files."""
    named = [path for _, path in flag_class_paths(args)]
    for flag, value in flag_values(args):
        if flag == "--model.residual" and not value.lstrip().startswith(("{", "[")):
            named.append(value)
        elif flag in ("-c", "--config") and Path(value).is_file():
            named += class_paths(yaml.safe_load(read_recipe(Path(value))))
    return [path for path in named if "." in path]


def undotted_class_path_fix(path: str) -> str:
    """What to write instead of a `class_path` without a module: the class of a registered strategy name, or the
    closest strategy name; the bare rule otherwise (the name may be meant for any class-typed setting)."""
    if path in RESIDUALS:
        cls = RESIDUALS[path]
        return (
            f"a class_path names a class with its module: class_path: {cls.__module__}.{cls.__qualname__} "
            f"(or residual: {path}, without arguments)"
        )
    close = difflib.get_close_matches(path, list(RESIDUALS), n=1)
    if close:
        return (
            "a class_path names a class with its module, e.g. mhar_lightning.residual.MHAR (a strategy name goes"
            f" alone: residual: {close[0]})"
        )
    return "a class_path names a class with its module: package.module.Class"


def class_paths(value: object) -> Iterator[str]:
    """Every `class_path` string in a parsed JSON or YAML value, however deeply nested."""
    if isinstance(value, dict):
        if isinstance(value.get("class_path"), str):
            yield value["class_path"]
        value = list(value.values())
    if isinstance(value, list):
        for item in value:
            yield from class_paths(item)


def importable(module: str, name: str) -> bool:
    """Whether `module` imports and has an attribute `name`."""
    try:
        return hasattr(importlib.import_module(module), name)
    except ImportError:
        return False


def one_line(message: str) -> str:
    """A jsonargparse union error cut to its informative line (the reasons a value fits no accepted type)."""
    lines = message.splitlines()
    reasons = [line.strip().removeprefix("- ") for line in lines if line.strip().startswith("- ")]
    reasons = [reason for reason in reasons if not reason.startswith("Expected a ")]
    return reasons[0] if len(lines) > 1 and reasons else message


def check_data(model: LanguageModel, datamodule: TokenDataModule) -> None:
    """Before any step: the prepared data must come from the requested tokenizer, and that tokenizer must be the one
    a converted model (`model.init_from`) ships."""
    try:
        if datamodule.path is not None and (Path(datamodule.path) / INDEX_FILE).is_file():  # else setup names it
            ShardIndex.load(Path(datamodule.path)).check_tokenizer(datamodule.tokenizer, Path(datamodule.path))
        if model.init_from is not None:
            check_data_tokenizer(model.init_from, datamodule.tokenizer, datamodule.tokenizer_name)
    except ValueError as error:  # ShardError, ConversionError
        raise ConfigError(str(error)) from error
