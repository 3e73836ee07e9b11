"""Hugging Face export of every strategy and model shape: routed models load with trust_remote_code and match the
kit's logits and greedy tokens; `sum` stays a LlamaForCausalLM; the tokenizer travels with the export."""

import json
import os

import lightning
import pytest
import torch
from eval_helpers import CONFIG, CONVERTED_SHAPE, STRATEGIES, random_decoder, trained_checkpoint
from safetensors import safe_open

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")

from mhar_lightning.cli import main as mhar  # noqa: E402
from mhar_lightning.config import ModelConfig  # noqa: E402
from mhar_lightning.convert import ConversionError, export_hf  # noqa: E402
from mhar_lightning.convert.hf_routed import check_exportable  # noqa: E402
from mhar_lightning.data.tokenizer import ByteTokenizer, load_tokenizer  # noqa: E402
from mhar_lightning.eval.generate import generate  # noqa: E402
from mhar_lightning.eval.loading import load_model  # noqa: E402

TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))


def load_export(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()


@pytest.mark.parametrize("shape", ["default", "converted"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_export_matches_logits_and_greedy_tokens(strategy, shape, tmp_path):
    """Every strategy, in the default shape and with every field Hugging Face conversion accepts."""
    model = random_decoder(strategy, config=CONFIG if shape == "default" else CONVERTED_SHAPE)
    out = export_hf(model, tmp_path / f"export-{strategy}", tokenizer=ByteTokenizer())
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == ("llama" if strategy == "sum" else "mhar")
    hf = load_export(out)
    assert type(hf).__name__ == ("LlamaForCausalLM" if strategy == "sum" else "MharForCausalLM")
    with torch.no_grad():
        torch.testing.assert_close(hf(TOKENS).logits, model(TOKENS), rtol=1e-5, atol=1e-5)
    prompt = TOKENS[:1, :6]
    ours = list(generate(model, prompt[0].tolist(), 10))
    theirs = hf.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert theirs[0, 6:].tolist() == ours


def test_export_left_padded_batch_matches_unpadded_rows(tmp_path):
    model = random_decoder("delta-mhar")
    hf = load_export(export_hf(model, tmp_path / "padded"))
    short = TOKENS[0, :5]
    ids = torch.stack([torch.cat([torch.zeros(3, dtype=torch.long), short]), TOKENS[1, :8]])
    mask = torch.tensor([[0] * 3 + [1] * 5, [1] * 8])
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = hf(ids, attention_mask=mask, position_ids=position_ids).logits
        torch.testing.assert_close(logits[0, 3:], model(short[None])[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits[1], model(TOKENS[1:, :8])[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["byte", "gpt2"])
def test_tokenizer_travels_with_the_export(name, tmp_path):
    text = "Depth routing, 2024: wörds\n\n   def f(x):\treturn x**2  \n"
    ours = load_tokenizer(name)
    config = ModelConfig(vocab_size=256 if name == "byte" else 50304, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1)
    from mhar_lightning.model import Decoder

    out = export_hf(Decoder(config, "mhar"), tmp_path / name, tokenizer=ours)
    theirs = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    assert theirs(text)["input_ids"] == ours.encode(text)
    assert theirs.decode(ours.encode(text)) == text
    assert theirs.eos_token_id == ours.eot_id == json.loads((out / "config.json").read_text())["eos_token_id"]


@pytest.mark.parametrize("residual", ["delta-mhar", "hyper-connections"])
def test_cli_exports_a_trained_checkpoint(residual, tmp_path):
    checkpoint, _ = trained_checkpoint(tmp_path / "run", residual)
    with pytest.raises(SystemExit) as done:
        mhar(["export-hf", str(checkpoint), str(tmp_path / "hf")])
    assert done.value.code == 0
    model = load_model(checkpoint, device="cpu").model
    hf = load_export(tmp_path / "hf")
    tokens = TOKENS[:, :16]
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=1e-5, atol=1e-5)
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", trust_remote_code=True)("ab")["input_ids"] == [
        97,
        98,
    ]


@pytest.mark.parametrize(
    "strategy, dtype", [("sum", torch.bfloat16), ("mhar-block", torch.bfloat16), ("sum", torch.float32)]
)
def test_cli_export_keeps_the_checkpoint_dtype(strategy, dtype, tmp_path):
    """A checkpoint stored in bf16 (as `mhar consolidate --dtype bfloat16` writes one) exports as bf16, fp32 as fp32."""
    model = random_decoder(strategy)
    checkpoint = tmp_path / "model.ckpt"
    torch.save(
        {
            "state_dict": {f"decoder.{name}": t.to(dtype) for name, t in model.state_dict().items()},
            "hyper_parameters": {"model_config": CONFIG.to_dict(), "residual": model.final_residual.spec()},
            "datamodule_hyper_parameters": {"tokenizer": "byte"},
            "pytorch-lightning_version": lightning.__version__,
        },
        checkpoint,
    )
    with pytest.raises(SystemExit) as done:
        mhar(["export-hf", str(checkpoint), str(tmp_path / "hf")])
    assert done.value.code == 0
    name = str(dtype).removeprefix("torch.")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == name
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as stored:
        dtypes = {stored.get_slice(key).get_dtype() for key in stored.keys()}  # noqa: SIM118 (a handle, not a dict)
    assert dtypes == {"BF16" if name == "bfloat16" else "F32"}
    assert {p.dtype for p in load_export(tmp_path / "hf").parameters()} == {dtype}
    model.load_state_dict({name: t.to(dtype) for name, t in model.state_dict().items()})  # the stored values, in fp32
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(TOKENS).logits, model(TOKENS), rtol=1e-5, atol=1e-5)


def test_unexportable_strategies_and_shapes_are_refused():
    with pytest.raises(ConversionError, match="residual 'mystery' has no Hugging Face implementation"):
        check_exportable(ModelConfig(), "mystery")
