"""Mid-training a Hugging Face Llama: convert, prepare with its tokenizer, fit, resume and validate through `mhar`, and
the first training loss and gradients equal those of `transformers` on the same batch."""

import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from cli_helpers import REPO, scalars
from hf_helpers import tokenizers, trained_llama, transformers, write_corpus

from mhar_lightning.cli import main
from mhar_lightning.convert import load_decoder
from mhar_lightning.convert.hf_llama import hf_names
from mhar_lightning.data import TokenDataModule

RECIPE = REPO / "recipes" / "midtrain" / "demo.yaml"
SEQ, BATCH = 32, 4
DELTA = ["--residual", "delta-mhar", "--heads", "4", "--block-size", "2"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: one intra-op thread is faster than several competing for shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A trained Hugging Face Llama with a 300-token `tokenizers` vocabulary, and a JSONL corpus of its language."""
    root = tmp_path_factory.mktemp("midtrain")
    model = trained_llama(root / "hf", steps=20)
    return root, model, write_corpus(root / "corpus.jsonl")


@pytest.fixture(scope="module")
def converted(source):
    """`source` converted to delta-MHAR (`conv`) and its corpus prepared with the source's tokenizer (`data`)."""
    root, hf, corpus = source
    conv, data = root / "conv", root / "data"
    assert mhar("convert-hf", root / "hf", conv, *DELTA) == 0
    # the source directory and the converted one ship the same tokenizer: shards match either by content
    assert mhar("prepare", corpus, data, "--tokenizer", root / "hf", "--no-progress") == 0  # as docs/midtrain.md
    return root, hf, conv, data


def mhar(*args: str) -> int:
    """Exit status of `mhar <args>`."""
    try:
        main([str(arg) for arg in args])
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 1
    return 0


def fit_args(root: Path, conv: Path, data: Path, max_steps: int) -> list[str]:
    """The README's `mhar fit` command on the CPU recipe, shrunk to a few seconds."""
    return [
        "--config", RECIPE,
        "--model.init_from", conv, "--data.tokenizer", conv, "--data.path", data,
        "--trainer.default_root_dir", root,
        "--trainer.max_steps", max_steps,
        "--trainer.val_check_interval", 2,
        "--trainer.limit_val_batches", 2,
        "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false",
        "--checkpoint.every_n_train_steps", 1,
        "--data.seq_len", SEQ,
        "--data.batch_size", BATCH,
    ]  # fmt: skip


def first_batch(conv: Path, data: Path) -> torch.Tensor:
    """The first training batch of a run with `fit_args` (same data seed, one process)."""
    datamodule = TokenDataModule(path=str(data), tokenizer=str(conv), seq_len=SEQ, batch_size=BATCH)
    datamodule.setup("fit")
    return next(iter(datamodule.train_dataloader()))


def test_convert_prepare_fit_resume_validate(converted, tmp_path, capsys):
    root, hf, conv, data = converted
    run = tmp_path / "run"
    assert (conv / "tokenizer.json").read_bytes() == (root / "hf" / "tokenizer.json").read_bytes()

    assert mhar("fit", *fit_args(run, conv, data, max_steps=2)) == 0
    batch = first_batch(conv, data)
    with torch.no_grad():
        reference = hf.train()(batch, labels=batch).loss.item()
    assert reference < 0.6 * math.log(hf.config.vocab_size)  # a trained model, not a uniform guess
    assert scalars(run, "train/loss")[0] == pytest.approx(reference, rel=1e-5)
    weights = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    assert weights["decoder.embed.weight"].shape == (300, 64)  # the checkpoint's vocabulary, not rounded to 320

    assert mhar("fit", *fit_args(run, conv, data, max_steps=4), "--ckpt_path", "last") == 0
    assert torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"] == 4
    assert sorted(scalars(run, "train/loss", version=1)) == [2, 3]
    capsys.readouterr()
    assert mhar("validate", *fit_args(run, conv, data, max_steps=4), "--ckpt_path", "last") == 0
    assert "val/loss" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--model.model_overrides.norm_eps", "1e-5"], "sets norm_eps=1e-05 but init_from=.* has norm_eps=1e-06"),
        (["--model.model_overrides.d_model", "128"], "sets d_model=128 but init_from=.* has d_model=64"),
        (["--model.preset", "tiny"], "model.preset=tiny sets vocab_size=256 but init_from=.* has vocab_size=300"),
        (["--model.residual", "mhar"], "model.residual=mhar but init_from=.* holds a 'delta-mhar' model"),
        (
            ["--model.residual", '{"class_path": "mhar_lightning.residual.DeltaMHAR", "init_args": {"heads": 2}}'],
            "model.residual sets heads=2 but init_from=.* has heads=4",
        ),
        (["--data.tokenizer", "gpt2"], "data.tokenizer has 50257 tokens but .* has a 300-token vocabulary"),
        (["--data.tokenizer", "byte"], "data was prepared with tokenizer .*vocab 300.* but 'byte' .vocab 256"),
    ],
    ids=["norm_eps", "d_model", "preset", "residual", "heads", "bigger-tokenizer", "data-tokenizer"],
)
def test_flags_that_contradict_the_converted_model_are_refused(converted, tmp_path, capsys, flags, message):
    _, _, conv, data = converted
    capsys.readouterr()
    assert mhar("fit", *fit_args(tmp_path / "run", conv, data, max_steps=2), *flags) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("mhar: error: ")
    assert re.search(message, err), err
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before any step


def test_data_from_another_tokenizer_than_the_models_is_refused(source, tmp_path, capsys):
    root, _, corpus = source
    conv, data = tmp_path / "conv", tmp_path / "data"
    assert mhar("convert-hf", root / "hf", conv, "--residual", "sum") == 0
    assert mhar("prepare", corpus, data, "--tokenizer", "byte", "--val-fraction", "0.1", "--no-progress") == 0
    capsys.readouterr()
    args = [*fit_args(tmp_path / "run", conv, data, max_steps=1), "--data.tokenizer", "byte"]
    assert mhar("fit", *args) == 2
    assert capsys.readouterr().err.strip() == (
        f"mhar: error: data.tokenizer=byte is not the tokenizer that init_from={conv} ships (its tokenizer files "
        f"differ): use --data.tokenizer {conv}"
    )


@pytest.mark.parametrize("residual", [["--residual", "sum"], DELTA], ids=["sum", "delta-mhar"])
def test_conversion_is_exact_in_training(source, tmp_path, residual):
    """Loss and every pretrained weight's gradient on one batch, in training mode, equal those of `transformers`."""
    root, hf, _ = source
    assert mhar("convert-hf", root / "hf", tmp_path / "conv", *residual) == 0
    ours = load_decoder(tmp_path / "conv").train()
    hf.train().zero_grad()
    batch = torch.randint(0, hf.config.vocab_size, (2, 25), generator=torch.Generator().manual_seed(1))
    reference = hf(batch, labels=batch).loss
    reference.backward()
    loss = F.cross_entropy(ours(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
    loss.backward()
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-6)
    theirs = dict(hf.named_parameters())
    for name, param in ours.named_parameters():
        if "residual" not in name:
            torch.testing.assert_close(param.grad, theirs[hf_names(ours.config)[name]].grad, rtol=1e-4, atol=1e-6)


def test_a_converted_directory_generates_what_transformers_generates(converted, capsys):
    """`mhar generate DIR` reads the tokenizer that `convert-hf` copied, and greedy decoding of the converted model
    (zero gates: the source's function) continues a prompt with the tokens `transformers` picks."""
    root, hf, conv, _ = converted
    prompt = "the quick brown fox"
    args = ["--prompt", prompt, "--max-new-tokens", "8", "--temperature", "0", "--device", "cpu"]
    assert mhar("generate", conv, *args) == 0
    tokenizer = tokenizers.Tokenizer.from_file(str(root / "hf" / "tokenizer.json"))
    ids = tokenizer.encode(prompt).ids
    eos = hf.config.eos_token_id
    with torch.no_grad():
        greedy = hf.eval().generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=eos)[0]
    new = greedy[len(ids) :].tolist()
    new = new[: new.index(eos)] if eos in new else new
    assert len(new) >= 4  # a continuation, not an immediate end of text
    assert capsys.readouterr().out == tokenizer.decode(ids + new) + "\n"


def test_sum_midtraining_exports_back_to_transformers(converted, tmp_path):
    root, hf, _, data = converted
    conv, run, back = tmp_path / "conv", tmp_path / "run", tmp_path / "back"
    assert mhar("convert-hf", root / "hf", conv, "--residual", "sum") == 0
    assert mhar("fit", *fit_args(run, conv, data, max_steps=2), "--model.optimizer.lr", "1e-2") == 0
    assert mhar("export-hf", run / "checkpoints" / "last.ckpt", back) == 0
    exported = transformers.LlamaForCausalLM.from_pretrained(back, attn_implementation="eager").eval()
    trained = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    ours = load_decoder(conv)
    ours.load_state_dict({name.removeprefix("decoder."): t for name, t in trained.items()})
    batch = first_batch(conv, data)
    with torch.no_grad():
        torch.testing.assert_close(exported(batch).logits, ours.eval()(batch), rtol=1e-5, atol=1e-5)
        assert (exported(batch).logits - hf.eval()(batch).logits).abs().max() > 1e-3  # it did train
    assert (back / "tokenizer.json").read_bytes() == (root / "hf" / "tokenizer.json").read_bytes()
    assert exported.config.eos_token_id == hf.config.eos_token_id


def test_every_converted_shape_midtrains_and_exports_back_with_its_tokenizer(tmp_path):
    """A random Llama with biases, a separate head size and Llama 3.1 RoPE scaling, converted to delta-MHAR,
    trained two steps and exported, loads in `transformers` (its own code) with the kit's logits and greedy tokens,
    and the original tokenizer."""
    source, conv, data, run, back = (tmp_path / name for name in ("hf", "conv", "data", "run", "back"))
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip
    trained_llama(source, steps=0, attention_bias=True, mlp_bias=True, head_dim=24, rope_parameters=rope)
    assert mhar("convert-hf", source, conv, *DELTA) == 0
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    assert mhar("prepare", corpus, data, "--tokenizer", source, "--val-fraction", "0.1", "--no-progress") == 0
    assert mhar("fit", *fit_args(run, conv, data, max_steps=2), "--model.optimizer.lr", "1e-2") == 0
    assert mhar("export-hf", run / "checkpoints" / "last.ckpt", back) == 0

    exported = transformers.AutoModelForCausalLM.from_pretrained(back, trust_remote_code=True).eval()
    ours = load_decoder(conv)
    trained = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    ours.load_state_dict({name.removeprefix("decoder."): t for name, t in trained.items()})
    assert ours.config.rope_scaling is not None and ours.config.head_dim == 24 and ours.config.mlp_bias
    batch = first_batch(conv, data)
    with torch.no_grad():
        torch.testing.assert_close(exported(batch).logits, ours.eval()(batch), rtol=1e-5, atol=1e-5)
    gates = [t for name, t in trained.items() if name.endswith("residual.gate")]
    assert max(float(g.abs().max()) for g in gates) > 0  # the routing trained, so the export is not the source

    text = "the quick brown fox"
    original = transformers.PreTrainedTokenizerFast(tokenizer_file=str(source / "tokenizer.json"))
    loaded = transformers.AutoTokenizer.from_pretrained(back, trust_remote_code=True)
    ids = loaded(text)["input_ids"]
    assert ids == original(text)["input_ids"] and loaded.decode(ids) == text
    prompt = torch.tensor([ids])
    greedy = exported.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    tokens = prompt
    for _ in range(6):
        with torch.no_grad():
            tokens = torch.cat([tokens, ours(tokens)[:, -1:].argmax(-1)], dim=1)
    assert greedy.tolist() == tokens.tolist()
