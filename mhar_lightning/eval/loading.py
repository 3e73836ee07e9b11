"""Open any checkpoint the kit writes for inference: a Lightning `.ckpt` (also a consolidated FSDP one) or a
converted directory, with the tokenizer it was trained with."""

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from mhar_lightning.checkpoint.finite import check_finite_state
from mhar_lightning.checkpoint.read_file import read_checkpoint
from mhar_lightning.checkpoint.read_sharded import META_FILE
from mhar_lightning.config import ModelConfig
from mhar_lightning.convert.checkpoint import CONFIG_FILE, load_decoder
from mhar_lightning.data.tokenizer import Tokenizer, load_tokenizer, ships_tokenizer
from mhar_lightning.dtypes import DTYPES
from mhar_lightning.model import Decoder
from mhar_lightning.module import LanguageModel
from mhar_lightning.residual import make_residual
from mhar_lightning.residual.trust import add_residual_option, check_stored_residual


@dataclass
class Loaded:
    """A decoder in eval mode and its tokenizer."""

    model: Decoder
    tokenizer: Tokenizer
    init_from: str | None = None
    """The converted directory the training run started from, if any."""

    @property
    def device(self) -> torch.device:
        return self.model.embed.weight.device


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(
    checkpoint: str | Path, tokenizer: str | None = None, device: str | None = None, dtype: str | None = None
) -> Loaded:
    """The decoder of `checkpoint` on `device` (default: CUDA if present) in `dtype` (default: bfloat16 on CUDA,
    float32 on CPU), with `tokenizer` (default: the one recorded by the training run)."""
    path = Path(checkpoint)
    device = check_device(device or default_device())
    dtype = dtype or ("bfloat16" if torch.device(device).type == "cuda" else "float32")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    init_from = None
    if path.is_dir() and (path / CONFIG_FILE).is_file():  # a converted directory ships its source's tokenizer
        model, recorded = load_decoder(path), str(path) if ships_tokenizer(path) else None
        check_finite_state(model.state_dict(), str(path))
    elif path.is_dir() and (path / META_FILE).is_file():
        raise ValueError(f"{path} is a sharded checkpoint: merge it first with `mhar consolidate {path} model.ckpt`")
    elif path.is_dir():
        hint = (
            f": it looks like a Hugging Face model, so convert it first with `mhar convert-hf {path} OUT` and pass OUT"
            if (path / "config.json").is_file()
            else ": pass a .ckpt file, a consolidated checkpoint or a converted directory"
        )
        raise ValueError(f"{path} is a folder without {CONFIG_FILE}, so not a checkpoint{hint}")
    elif path.is_file():
        raw = read_checkpoint(path)  # a damaged file is one line naming the fix
        hparams = raw.get("hyper_parameters") or {}
        model, init_from = run_decoder(path, raw), hparams.get("init_from")
        recorded = (raw.get("datamodule_hyper_parameters") or {}).get("tokenizer")
    else:
        raise FileNotFoundError(
            f"checkpoint {path} does not exist: pass a .ckpt file, a consolidated checkpoint or a converted directory"
        )
    name = tokenizer or recorded
    if name is None:
        raise ValueError(f"{path} records no tokenizer: pass --tokenizer (e.g. gpt2, or the model's tokenizer file)")
    tok = load_tokenizer(name)
    if tok.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"tokenizer {name!r} has {tok.vocab_size} tokens but the model only {model.config.vocab_size}: "
            "pass the tokenizer the model was trained with"
        )
    model = model.to(device=device, dtype=DTYPES[dtype]).eval().requires_grad_(False)
    return Loaded(model, tok, init_from)


def check_device(device: str) -> str:
    """`device` if this machine has it; else a one-line error naming the devices it does have."""
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}: use cpu, cuda or cuda:N") from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            raise ValueError(f"device {device!r} is not available: this machine has no CUDA GPU, use cpu")
        if parsed.index is not None and parsed.index >= count:
            raise ValueError(f"device {device!r} is not available: this machine has cuda:0 to cuda:{count - 1}")
    return device


def run_decoder(path: Path, raw: dict) -> Decoder:
    """The decoder of a `mhar fit` checkpoint `raw` (read from `path`): rebuilt from the shape it records, which
    also holds for runs that started from a converted directory (`init_from`) no longer at hand."""
    hparams = raw.get("hyper_parameters") or {}
    check_stored_residual(hparams.get("residual"), f"checkpoint {path}")
    if "model_config" not in hparams:  # written before checkpoints recorded the whole shape
        module = LanguageModel.load_from_checkpoint(
            path, map_location="cpu", compile=False, activation_checkpointing="none", init_from=None
        )
        return module.decoder
    decoder = Decoder(ModelConfig(**hparams["model_config"]), make_residual(hparams["residual"]))
    decoder.load_state_dict({k.removeprefix("decoder."): v for k, v in raw["state_dict"].items()})
    return decoder


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """The checkpoint argument and the options every inference command shares."""
    parser.add_argument("checkpoint", type=Path, help=".ckpt file, consolidated checkpoint or converted directory")
    parser.add_argument(
        "--tokenizer", help="tokenizer name or file (default: the one the run trained with, or a directory's own)"
    )
    parser.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    add_residual_option(parser)


def load_from_args(args: argparse.Namespace) -> Loaded:
    return load_model(args.checkpoint, args.tokenizer, args.device, args.dtype)
