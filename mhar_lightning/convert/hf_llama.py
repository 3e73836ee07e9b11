"""The Hugging Face Llama side: config and tensor-name mapping, and a validated lazy view of a local checkpoint."""

import json
import shutil
from functools import partial
from pathlib import Path

import torch

from mhar_lightning.config import ModelConfig, RopeScaling
from mhar_lightning.convert.safetensors_io import ConversionError, SafetensorsDir, TensorEntry, check_tensors
from mhar_lightning.model import Decoder

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
"""Config keys that carry over unchanged from a source checkpoint to an export (generation needs them)."""
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
"""Buffers some older checkpoints save; RoPE tables are recomputed here."""
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "original/tokenizer.model",
)
"""Tokenizer files of a Hugging Face model directory that travel with its weights (convert and export)."""
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
FIELD_TYPES = {
    **dict.fromkeys(
        (*REQUIRED_KEYS, "num_key_value_heads", "head_dim", "max_position_embeddings", "pretraining_tp"), (int,)
    ),
    **dict.fromkeys(("rms_norm_eps", "rope_theta", "initializer_range", "partial_rotary_factor"), (int, float)),
    **dict.fromkeys(("attention_dropout", "mlp_dropout"), (int, float)),
    **dict.fromkeys(("tie_word_embeddings", "attention_bias", "mlp_bias"), (bool,)),
    **dict.fromkeys(("hidden_act",), (str,)),
    **dict.fromkeys(("rope_parameters", "rope_scaling"), (dict,)),
}
"""The JSON type of each config.json field the conversion reads (null, where allowed, is checked elsewhere)."""
TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "an object"}


def copy_tokenizer_files(src: str | Path, out: str | Path) -> list[str]:
    """Copy the tokenizer files that `src` has into `out` (same relative paths); returns the names copied."""
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            (Path(out) / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(src) / name, Path(out) / name)
            copied.append(name)
    return copied


def rope_scaling_of(rope: dict) -> RopeScaling | None:
    """The `RopeScaling` of a Hugging Face `rope_parameters`/`rope_scaling` entry (None when unscaled)."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise ConversionError(
            f"rope_scaling type {rope_type!r} is not supported; supported: default and llama3 (Llama 3.1-style)"
        )
    missing = [key for key in LLAMA3_ROPE_KEYS if rope.get(key) is None]
    if missing:
        raise ConversionError(f"rope_scaling of type llama3 lacks {', '.join(missing)}")
    return RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_seq_len=int(rope["original_max_position_embeddings"]),
    )


def llama3_rope_parameters(scaling: RopeScaling | None) -> dict | None:
    """`scaling` under Hugging Face's Llama 3.1 key names (`LLAMA3_ROPE_KEYS`); None when unscaled."""
    if scaling is None:
        return None
    values = (scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor, scaling.original_max_seq_len)
    return dict(zip(LLAMA3_ROPE_KEYS, values, strict=True))


def hf_config_to_model_config(hf_config: dict) -> ModelConfig:
    """The `ModelConfig` of a Hugging Face `config.json`; refuses anything this decoder would compute differently."""
    check_field_types(hf_config)
    architectures = hf_config.get("architectures")
    if architectures != list(SUPPORTED_ARCHITECTURES):
        named = ", ".join(architectures) if architectures else 'none (config.json lacks "architectures")'
        raise ConversionError(f"unsupported architecture {named}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    missing = [key for key in REQUIRED_KEYS if hf_config.get(key) is None]
    if missing:
        raise ConversionError(f"config.json lacks {', '.join(missing)}")
    rope = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    hidden, heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or hidden // heads
    if hf_config.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"hidden_act={hf_config['hidden_act']!r} is not supported; the MLP is SwiGLU (silu)")
    for key in ("attention_dropout", "mlp_dropout"):
        if hf_config.get(key):
            raise ConversionError(f"{key}={hf_config[key]} is not supported: this decoder has no dropout; set it to 0")
    partial = rope.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ConversionError(f"partial_rotary_factor={partial} is not supported: RoPE rotates whole heads here")
    if hf_config.get("pretraining_tp", 1) != 1:
        raise ConversionError(f"pretraining_tp={hf_config['pretraining_tp']} is not supported; set it to 1")
    return ModelConfig(
        vocab_size=hf_config["vocab_size"],
        d_model=hidden,
        n_layers=hf_config["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf_config.get("num_key_value_heads") or heads,
        ffn_hidden=hf_config["intermediate_size"],
        rope_theta=float(rope.get("rope_theta", hf_config.get("rope_theta", 10000.0))),
        max_seq_len=hf_config.get("max_position_embeddings", 2048),
        norm_eps=hf_config.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        init_std=hf_config.get("initializer_range", 0.02),
        head_size=None if head_dim * heads == hidden else head_dim,
        rope_scaling=rope_scaling_of(rope),
        attention_bias=bool(hf_config.get("attention_bias", False)),
        mlp_bias=bool(hf_config.get("mlp_bias", False)),
    )


def check_field_types(hf_config: dict) -> None:
    """Refuse a config.json field of the wrong JSON type (e.g. `"hidden_size": "64"`), which would fail deep in
    the conversion or, for a flag such as `tie_word_embeddings: "no"`, convert silently into another model."""
    for key, types in FIELD_TYPES.items():
        value = hf_config.get(key)
        if value is not None and ((isinstance(value, bool) and bool not in types) or not isinstance(value, types)):
            raise ConversionError(
                f"{key}={json.dumps(value)} is not {TYPE_NAMES[types[-1]]}: fix that field of config.json"
            )


def model_config_to_hf_config(config: ModelConfig, dtype: torch.dtype, tokens: dict | None = None) -> dict:
    """A `LlamaForCausalLM` `config.json` for `config` (plus token ids from `tokens`, e.g. the source config)."""
    dtype_name = str(dtype).removeprefix("torch.")
    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        rope |= {"rope_type": "llama3", **llama3_rope_parameters(config.rope_scaling)}
    return {
        "architectures": list(SUPPORTED_ARCHITECTURES),
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.ffn_hidden,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "initializer_range": config.init_std,
        "rope_theta": config.rope_theta,
        "rope_parameters": rope,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": config.attention_bias,
        "mlp_bias": config.mlp_bias,
        "dtype": dtype_name,
        **{key: (tokens or {})[key] for key in TOKEN_KEYS if key in (tokens or {})},
    }


def hf_names(config: ModelConfig) -> dict[str, str]:
    """Our parameter name -> the Hugging Face Llama tensor name, in our parameter order (no tied head)."""
    names = {"embed.weight": "model.embed_tokens.weight"}
    for i in range(config.n_layers):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        attn = ("weight", "bias") if config.attention_bias else ("weight",)
        mlp = ("weight", "bias") if config.mlp_bias else ("weight",)
        names[ours + "attn_norm.weight"] = theirs + "input_layernorm.weight"
        names |= {f"{ours}attn.{p}.{t}": f"{theirs}self_attn.{p}_proj.{t}" for p in "qkvo" for t in attn}
        names[ours + "mlp_norm.weight"] = theirs + "post_attention_layernorm.weight"
        names |= {f"{ours}mlp.{p}.{t}": f"{theirs}mlp.{p}_proj.{t}" for p in ("gate", "up", "down") for t in mlp}
    names["norm.weight"] = "model.norm.weight"
    if not config.tie_embeddings:
        names["head.weight"] = "lm_head.weight"
    return names


class HFLlamaCheckpoint:
    """A local Hugging Face Llama directory (`config.json` + safetensors), read lazily and validated."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        config_file = self.path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{self.path} has no config.json; point at a Hugging Face model directory")
        try:
            self.hf_config: dict = json.loads(config_file.read_text(encoding="utf-8"))
        except ValueError as error:  # not UTF-8, or not JSON
            raise ConversionError(f"{config_file} is not a JSON file ({error}): restore it from the source") from None
        if not isinstance(self.hf_config, dict):
            raise ConversionError(f"{config_file} is not a JSON object: restore it from the source")
        try:
            self.config = hf_config_to_model_config(self.hf_config)
        except ConversionError as error:
            raise ConversionError(f"{config_file}: {error}") from None
        self.tensors = SafetensorsDir(self.path, follow_links=False)  # a Hugging Face cache links to its blobs
        self.dtype = self.tensors.shape_and_dtype(self.tensors.names()[0])[1]

    def entries(self, model: Decoder, dtype: torch.dtype | None = None) -> list[TensorEntry]:
        """Our non-routing parameters of `model` (built from `self.config`), read from this checkpoint.

        Raises one error listing every missing, unexpected or mis-shaped tensor before anything is read.
        """
        names = hf_names(self.config)
        params = dict(model.named_parameters())
        expected = {hf: tuple(params[ours].shape) for ours, hf in names.items()}
        ignored = ("lm_head.weight",) if self.config.tie_embeddings else ()
        found = {
            name: self.tensors.shape_and_dtype(name)[0]
            for name in self.tensors.names()
            if name not in ignored and not name.endswith(IGNORED_SUFFIXES)
        }
        check_tensors(f"checkpoint {self.path}", expected, found)
        return [
            TensorEntry(
                ours, expected[hf], dtype or self.tensors.shape_and_dtype(hf)[1], partial(self.tensors.tensor, hf)
            )
            for ours, hf in names.items()
        ]
