"""Hugging Face Llama import/export: exact logits against transformers, the converted format, clear errors."""

import json
import os
import shutil
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")

from mhar_lightning.cli import main as mhar  # noqa: E402
from mhar_lightning.commands.convert import export_main, main  # noqa: E402
from mhar_lightning.convert import (  # noqa: E402 - after HF_HUB_OFFLINE is set
    ConversionError,
    converted_state_dict,
    export_hf,
    hf_config_to_model_config,
    load_converted,
    load_decoder,
    load_hf_llama,
    save_converted,
)
from mhar_lightning.model import Decoder  # noqa: E402

SHAPE = {
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 320,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
}
DELTA = {"heads": 4, "block_size": 1}
TOKENS = torch.randint(0, SHAPE["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))


def random_llama(tie: bool = False) -> "transformers.LlamaForCausalLM":
    """A small LlamaForCausalLM with every weight random (norm gains too), so logits are O(1)."""
    config = transformers.LlamaConfig(**SHAPE, tie_word_embeddings=tie, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return model


def hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def our_logits(model: Decoder) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(TOKENS)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A sharded (>= 2 safetensors files + index) untied GQA Llama and its logits."""
    path = tmp_path_factory.mktemp("hf")
    model = random_llama()
    model.save_pretrained(path, max_shard_size="100KB")
    assert len(list(path.glob("model-*.safetensors"))) >= 2 and (path / "model.safetensors.index.json").is_file()
    return path, hf_logits(model)


@pytest.mark.parametrize("residual, args", [("sum", {}), ("delta-mhar", DELTA)])
def test_import_matches_transformers(hf_dir, residual, args):
    path, reference = hf_dir
    model = load_hf_llama(path, residual, **args)
    assert not any(p.is_meta for p in model.parameters())
    assert reference.abs().max() > 1
    torch.testing.assert_close(our_logits(model), reference, rtol=1e-5, atol=1e-5)


def test_delta_mhar_routing_starts_neutral_then_trains(hf_dir):
    path, reference = hf_dir
    model = load_hf_llama(path, "delta-mhar", **DELTA)
    routing = {n: p for n, p in model.named_parameters() if "residual" in n}
    assert routing and all(torch.all(p == (1 if "key_norm" in n else 0)) for n, p in routing.items())
    optimizer = torch.optim.AdamW(routing.values(), lr=1e-2)  # the pretrained weights stay fixed
    for _ in range(3):
        loss = nn.functional.cross_entropy(model.train()(TOKENS[:, :-1]).flatten(0, 1), TOKENS[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert all(block.residual.gate.abs().sum() > 0 for block in model.blocks)
    assert (our_logits(model) - reference).abs().max() > 1e-3


def test_converted_checkpoint_round_trip(hf_dir, tmp_path):
    path, reference = hf_dir
    out = save_converted(path, tmp_path / "conv", "delta-mhar", max_shard_size="60KB", **DELTA)
    meta = json.loads((out / "mhar_config.json").read_text())
    assert (
        meta["residual"] == {"class_path": "mhar_lightning.residual.delta.DeltaMHAR", "init_args": DELTA}
        and len(list(out.glob("model-*"))) >= 2
    )
    config, template, state = load_converted(out)
    assert config == hf_config_to_model_config(json.loads((path / "config.json").read_text()))
    fresh = Decoder(config, template)
    fresh.load_state_dict(state)  # strict: the lazily loaded dict names every parameter
    for model in (fresh, load_decoder(out)):
        torch.testing.assert_close(our_logits(model), reference, rtol=1e-5, atol=1e-5)
    assert all(p.dtype == torch.bfloat16 for p in load_decoder(out, dtype=torch.bfloat16).parameters())


def test_cli_convert_then_export_round_trips_through_transformers(hf_dir, tmp_path):
    path, reference = hf_dir
    assert main([str(path), str(tmp_path / "sum"), "--residual", "sum", "--max-shard-size", "100KB"]) == 0
    assert export_main([str(tmp_path / "sum"), str(tmp_path / "hf")]) == 0
    export_hf(load_decoder(tmp_path / "sum"), tmp_path / "hf_from_model")
    for exported in ("hf", "hf_from_model"):
        model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / exported, attn_implementation="eager")
        torch.testing.assert_close(hf_logits(model.eval()), reference, rtol=1e-5, atol=1e-5)


def refused(argv: list[str], capsys) -> str:
    """The one stderr line of `mhar argv`, which must exit 2 having printed nothing else."""
    with pytest.raises(SystemExit) as done:
        mhar(argv)
    out, err = capsys.readouterr()
    assert (done.value.code, out, len(err.strip().splitlines())) == (2, "", 1), err
    return err.strip()


HEADER_TOO_LARGE = struct.pack("<Q", 1 << 40) + b"{}"  # a safetensors header length of 1 TiB


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_size": "64"}, 'hidden_size="64" is not an integer: fix that field of config.json'),
        ({"num_hidden_layers": 2.5}, "num_hidden_layers=2.5 is not an integer: fix that field of config.json"),
        ({"num_attention_heads": True}, "num_attention_heads=true is not an integer: fix that field of config.json"),
        ({"rms_norm_eps": "small"}, 'rms_norm_eps="small" is not a number: fix that field of config.json'),
        ({"tie_word_embeddings": "no"}, 'tie_word_embeddings="no" is not true or false: fix that field of config.json'),
    ],
)
def test_convert_refuses_a_config_field_of_the_wrong_type_in_one_line(hf_dir, tmp_path, capsys, change, message):
    src = shutil.copytree(hf_dir[0], tmp_path / "src")
    config = json.loads((src / "config.json").read_text()) | change
    (src / "config.json").write_text(json.dumps(config))
    line = refused(["convert-hf", str(src), str(tmp_path / "out"), "--residual", "sum"], capsys)
    assert line == f"mhar convert-hf: error: {src / 'config.json'}: {message}"
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def converted_dir(hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("converted") / "sum"
    assert main([str(hf_dir[0]), str(out), "--residual", "sum"]) == 0
    return out


@pytest.mark.parametrize(
    "name, data, message",
    [
        ("model.safetensors", HEADER_TOO_LARGE, "{file} is not a readable safetensors file (Error while deserializing"
         " header: header too large): restore it from the source"),
        ("tokenizer.json", b"{not json", "{file} is not a Hugging Face tokenizer file (key must be a string at line 1"
         " column 2): restore it from the model it came with"),
        ("tokenizer.json", b'{"model": "caf\xe9"}', "{file} is not a Hugging Face tokenizer file ('utf-8' codec"
         " can't decode byte 0xe9 in position 14: invalid continuation byte): restore it from the model it came with"),
    ],
)  # fmt: skip
def test_a_damaged_file_of_a_converted_directory_is_one_line_naming_it(
    converted_dir, tmp_path, capsys, name, data, message
):
    conv = shutil.copytree(converted_dir, tmp_path / "conv")
    (conv / name).write_bytes(data)
    line = refused(["generate", str(conv), "--prompt", "x"], capsys)
    assert line == "mhar generate: error: " + message.format(file=conv / name)
    assert (conv / name).read_bytes() == data


def test_convert_refuses_a_safetensors_header_too_large_in_one_line(hf_dir, tmp_path, capsys):
    src = shutil.copytree(hf_dir[0], tmp_path / "src")
    shard = sorted(src.glob("model-*.safetensors"))[0]
    shard.write_bytes(HEADER_TOO_LARGE)
    line = refused(["convert-hf", str(src), str(tmp_path / "out"), "--residual", "sum"], capsys)
    assert line == (
        f"mhar convert-hf: error: {shard} is not a readable safetensors file (Error while deserializing header: header"
        " too large): restore it from the source"
    )
    assert not (tmp_path / "out").exists()


def test_tied_single_file_checkpoint(tmp_path):
    model = random_llama(tie=True)
    model.save_pretrained(tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    ours = load_hf_llama(tmp_path / "hf", "sum")
    assert ours.head.weight is ours.embed.weight
    torch.testing.assert_close(our_logits(ours), hf_logits(model), rtol=1e-5, atol=1e-5)
    save_converted(tmp_path / "hf", tmp_path / "conv", "sum")
    with safe_open(tmp_path / "conv" / "model.safetensors", "pt") as stored:
        assert "head.weight" not in stored.keys()  # noqa: SIM118 (a handle, not a dict)
    state = converted_state_dict(tmp_path / "conv")
    assert state["head.weight"] is state["embed.weight"]
    reloaded = load_decoder(tmp_path / "conv")
    assert reloaded.head.weight is reloaded.embed.weight
    export_hf(tmp_path / "conv", tmp_path / "back")
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager")
    torch.testing.assert_close(hf_logits(back.eval()), hf_logits(model), rtol=1e-5, atol=1e-5)


def test_refuses_bad_arguments(hf_dir, tmp_path, capsys):
    path, _ = hf_dir
    assert main([str(path), str(tmp_path / "y"), "--residual", "sum", "--heads", "8"]) == 1
    assert "residual 'sum' takes no arguments, not heads" in capsys.readouterr().err
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "old.txt").write_text("x")
    with pytest.raises(ConversionError, match="already exists and is not an empty directory"):
        save_converted(path, tmp_path / "busy", "sum")


def test_cli_passes_any_strategy_argument(hf_dir, tmp_path, capsys):
    path, reference = hf_dir

    def convert(out: str, *flags: str) -> int:
        return main([str(path), str(tmp_path / out), "--residual", "hyper-connections", *flags])

    assert convert("hc", "--residual-args", "rate=2,dynamic=false") == 0
    meta = json.loads((tmp_path / "hc" / "mhar_config.json").read_text())
    assert meta["residual"]["init_args"] == {"rate": 2, "dynamic": False}
    torch.testing.assert_close(our_logits(load_decoder(tmp_path / "hc")), reference, rtol=1e-5, atol=1e-5)
    for flags, message in [
        (["--residual-args", "rate"], "argument --residual-args: write 'rate' as KEY=VALUE pairs, e.g. rate=2"),
        (["--heads", "2", "--residual-args", "heads=4"], "--residual-args sets heads, and so does --heads: give it"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            convert("other", *flags)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert convert("other", "--residual-args", "rate=a") == 1
    assert "residual 'hyper-connections' cannot take {'rate': 'a'}" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()


@pytest.mark.parametrize("size", ["0", "0.4", "0GB"])
def test_a_shard_size_that_is_not_positive_is_refused(hf_dir, tmp_path, capsys, size):
    path, _ = hf_dir
    for command in (main, export_main):
        with pytest.raises(SystemExit) as exit_info:
            command([str(path), str(tmp_path / "out"), "--max-shard-size", size])
        assert exit_info.value.code == 2
        assert f"argument --max-shard-size: size '{size}' is not a positive number of bytes" in capsys.readouterr().err
    with pytest.raises(ConversionError, match="is not a positive number of bytes"):
        export_hf(load_hf_llama(path, "sum"), tmp_path / "out", max_shard_size=0)
    assert not (tmp_path / "out").exists()


def test_missing_and_unexpected_tensors_are_listed(tmp_path):
    model = random_llama()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    del state["model.layers.1.mlp.up_proj.weight"], state["lm_head.weight"]
    state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model.config.architectures = ["LlamaForCausalLM"]
    model.config.save_pretrained(tmp_path)
    with pytest.raises(ConversionError) as error:
        load_hf_llama(tmp_path, "sum")
    assert str(error.value).endswith(
        "missing 2 tensor(s): model.layers.1.mlp.up_proj.weight, lm_head.weight; "
        "unexpected 1 tensor(s): model.layers.0.self_attn.q_proj.bias"
    )


BASE = {"architectures": ["LlamaForCausalLM"], **SHAPE}
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # short, so that all three frequency bands occur at head_dim 16
}
VARIANTS = {
    "tied": {"tie_word_embeddings": True},
    "llama3.1-rope": {"rope_parameters": LLAMA31_ROPE},
    "biases": {"attention_bias": True, "mlp_bias": True},
    "head_dim": {"head_dim": 32},  # 4 heads of 32 on a width of 64
}


@pytest.mark.parametrize("residual, args", [("sum", {}), ("delta-mhar", DELTA)])
@pytest.mark.parametrize("variant", VARIANTS)
def test_llama_variants_match_transformers(variant, residual, args, tmp_path):
    """Each supported Llama variant converts exactly (logits of transformers), reloads, and a `sum` one exports back."""
    change = VARIANTS[variant]
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, **change, attn_implementation="eager"))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    hf.eval().save_pretrained(tmp_path / "hf")
    reference = hf_logits(hf)
    out = save_converted(tmp_path / "hf", tmp_path / "conv", residual, **args)
    stored = json.loads((out / "mhar_config.json").read_text())["model"]
    assert stored == hf_config_to_model_config(json.loads((tmp_path / "hf" / "config.json").read_text())).to_dict()
    torch.testing.assert_close(our_logits(load_decoder(out)), reference, rtol=1e-5, atol=1e-5)
    if variant == "llama3.1-rope":  # the scaling matters at these positions: the unscaled rope differs
        unscaled = transformers.LlamaConfig(**SHAPE, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
        plain = transformers.LlamaForCausalLM(unscaled)
        plain.load_state_dict(hf.state_dict())
        assert (hf_logits(plain.eval()) - reference).abs().max() > 1e-2
    if residual == "sum":
        export_hf(out, tmp_path / "back")
        back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager")
        torch.testing.assert_close(hf_logits(back.eval()), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"architectures": ["MistralForCausalLM"]}, "architecture MistralForCausalLM; supported: LlamaForCausalLM"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_scaling type 'yarn' is not supported"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling type 'linear' is not supported"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3 lacks low_freq_factor, high_freq_factor"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 is not supported"),
        ({"attention_dropout": 0.1}, "attention_dropout=0.1 is not supported"),
        ({"pretraining_tp": 2}, "pretraining_tp=2 is not supported"),
        ({"head_dim": 15}, "head size 15 must be positive and even"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"architectures": None}, 'unsupported architecture none .config.json lacks "architectures"'),
        ({"vocab_size": None}, "config.json lacks vocab_size"),
    ],
)
def test_unsupported_configs_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        hf_config_to_model_config(BASE | change)


def test_config_mapping_reads_old_and_new_rope_fields():
    old = hf_config_to_model_config(BASE | {"rope_scaling": None, "rope_theta": 1e6})
    new = hf_config_to_model_config(BASE | {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert old == new
    assert (old.d_model, old.n_layers, old.n_heads, old.n_kv_heads, old.ffn_hidden) == (64, 3, 4, 2, 128)
    assert (old.rope_theta, old.max_seq_len, old.norm_eps, old.tie_embeddings) == (1e6, 64, 1e-5, False)
    old31 = {k: v for k, v in LLAMA31_ROPE.items() if k != "rope_theta"}
    new31 = hf_config_to_model_config(BASE | {"rope_parameters": LLAMA31_ROPE})
    assert hf_config_to_model_config(BASE | {"rope_scaling": old31, "rope_theta": 5e5}) == new31
    assert new31.rope_scaling.factor == 8.0 and new31.rope_scaling.original_max_seq_len == 16
