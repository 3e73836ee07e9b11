"""`benchmarks/random_llama.py`: a random Llama checkpoint that `transformers` loads, whose tokenizer has exactly the
model's vocabulary, and that `mhar convert-hf` turns into a model computing the same logits."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import transformers

from mhar_lightning.commands.convert import main as convert_hf
from mhar_lightning.config import PRESETS
from mhar_lightning.convert import load_decoder
from mhar_lightning.data.tokenizer import load_tokenizer

_PATH = Path(__file__).parents[2] / "benchmarks" / "random_llama.py"
_SPEC = importlib.util.spec_from_file_location("random_llama", _PATH)
random_llama = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(random_llama)
VOCAB = 640  # the tiny preset's width, with room for a byte-level BPE and its special tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("random-llama") / "model"
    corpus = Path(json.__file__).parent  # the standard library's json package: a few hundred KB of text
    argv = [str(out), "--preset", "tiny", "--vocab", str(VOCAB), "--corpus", str(corpus), "--shard-gb", "0.0002"]
    assert random_llama.main(argv) == 0
    return out


def test_transformers_loads_it_with_the_shapes_vocabulary(checkpoint: Path) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    assert model.config.hidden_size == PRESETS["tiny"].d_model and not model.config.tie_word_embeddings
    assert len(json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]) == len(
        model.state_dict()
    )
    assert len(list(checkpoint.glob("*.safetensors"))) > 1  # the shard limit split the weights
    weight = model.model.layers[0].mlp.up_proj.weight
    assert weight.std().item() == pytest.approx(0.02, rel=0.1)
    tokenizer = load_tokenizer(str(checkpoint))
    assert tokenizer.vocab_size == VOCAB == model.config.vocab_size
    assert model.config.eos_token_id == tokenizer.eot_id
    text = "def f(x):\n    return x + 1\n"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_converted_model_computes_the_checkpoints_logits(checkpoint: Path, tmp_path: Path) -> None:
    assert convert_hf([str(checkpoint), str(tmp_path / "sum"), "--residual", "sum", "--dtype", "float32"]) == 0
    reference = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            load_decoder(tmp_path / "sum")(tokens), reference(tokens).logits, rtol=1e-5, atol=1e-5
        )
