"""`mhar evaluate` and `mhar generate` on a trained checkpoint, against losses computed here from the model's logits."""

import json
import math

import numpy as np
import pytest
import torch
from eval_helpers import random_decoder

from mhar_lightning.cli import main as mhar
from mhar_lightning.data.shards import TokenStream
from mhar_lightning.data.token_bytes import token_bytes
from mhar_lightning.data.tokenizer import ByteTokenizer, load_tokenizer
from mhar_lightning.eval.evaluate import evaluate_tokens
from mhar_lightning.eval.loading import load_model


@pytest.fixture(scope="module")
def run(trained_mhar_run):
    return trained_mhar_run  # (last.ckpt, prepared data) of a two-step MHAR fit, shared with the other eval tests


def reference_loss(model, tokens: list[int], bos: int, window: int) -> float:
    """Summed next-token loss of `tokens` (fp64), predicted `window` at a time from `bos` and the tokens before them,
    the last partial window reading as many earlier tokens as fit."""
    model, stream, total = model.double(), [bos, *tokens], 0.0
    for start in range(0, len(tokens), window):
        stop = min(start + window, len(tokens))
        begin = max(0, stop - window)
        logprobs = torch.log_softmax(model(torch.tensor([stream[begin:stop]]))[0], -1)
        total -= sum(float(logprobs[i - begin, tokens[i]]) for i in range(start, stop))
    return total


def test_evaluate_tokens_matches_reference_over_windows():
    model = random_decoder("mhar-block")
    targets = np.random.default_rng(0).integers(1, 256, 150).astype(np.uint16)
    targets[[40, 149]] = 0  # end-of-text tokens: in the loss, not in the bytes
    lengths = token_bytes(ByteTokenizer(), 256)
    scores = evaluate_tokens(model, targets, 0, lengths, batch_size=2, progress=False)
    expected = reference_loss(random_decoder("mhar-block"), targets.tolist(), 0, model.config.max_seq_len)
    assert scores.tokens == 150 and scores.bytes == 148
    assert scores.loss_sum == pytest.approx(expected, rel=1e-5)
    assert scores.loss == pytest.approx(expected / 150, rel=1e-5)


def test_token_bytes_of_tiktoken_and_bytes():
    gpt2 = token_bytes(load_tokenizer("gpt2"), 50304)
    ids = load_tokenizer("gpt2").encode("Hello, wörld")
    assert int(gpt2[ids].sum()) == len("Hello, wörld".encode())
    assert gpt2[50256] == 0 and gpt2[50257:].sum() == 0
    assert token_bytes(ByteTokenizer(), 256).tolist() == [0] + [1] * 255


TEXTS = [" ü", " Grüße, the 你好 🙂!", " the\n\tnaïve café"]


def sentencepiece_style_tokenizer(out):
    """A Llama 2 style `tokenizer.json`: word-start markers, byte fallback for what the vocabulary lacks, and a
    decoder that strips the marker of the first word."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    for piece in ["▁", "t", "h", "e", "▁t", "▁th", "▁the", "ü", "a"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "t"), ("▁t", "h"), ("▁th", "e")]
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    strip_first_space = decoders.Strip(" ", 1, 0)
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), strip_first_space]
    )
    tokenizer.add_special_tokens(["<unk>", "</s>"])
    out.mkdir()
    tokenizer.save(str(out / "tokenizer.json"))
    return out


@pytest.mark.parametrize("kind", ["byte-level BPE", "byte fallback"])
def test_token_bytes_of_a_tokenizer_json_count_utf8_bytes_like_the_byte_tokenizer(kind, tmp_path):
    """Tokens that are part of a character count their own bytes, so non-ASCII text has the bytes the byte
    tokenizer gives it (bits per byte then compare across tokenizers); special tokens count none."""
    from hf_helpers import EOS, corpus_lines, train_tokenizer

    if kind == "byte-level BPE":
        train_tokenizer(tmp_path / "hf", corpus_lines(50))
        tokenizer = load_tokenizer(str(tmp_path / "hf"))
    else:
        tokenizer = load_tokenizer(str(sentencepiece_style_tokenizer(tmp_path / "hf")))
    lengths = token_bytes(tokenizer, tokenizer.vocab_size + 3)
    by_byte = token_bytes(ByteTokenizer(), 256)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids).strip() == text.strip()
        assert any(len(tokenizer.decode([i]).encode()) != lengths[i] for i in ids)  # a piece of a character
        assert int(lengths[ids].sum()) == int(by_byte[ByteTokenizer().encode(text)].sum()) == len(text.encode())
    special = tokenizer.tokenizer.token_to_id(EOS if kind == "byte-level BPE" else "<unk>")
    assert lengths[tokenizer.eot_id] == lengths[special] == 0 and lengths[tokenizer.vocab_size :].sum() == 0


def refused(argv: list[str], capsys) -> str:
    """The one line `mhar` prints on stderr when it refuses `argv`, having written nothing on stdout."""
    with pytest.raises(SystemExit) as done:
        mhar(argv)
    out, err = capsys.readouterr()
    assert done.value.code not in (0, None) and out == ""
    assert len(err.strip().splitlines()) == 1, err
    return err.strip()


def test_cli_refuses_bad_options_before_evaluating(run, tmp_path, capsys, monkeypatch):
    checkpoint, data = run

    def never(*args, **kwargs):
        raise AssertionError("evaluated although an option was wrong")

    monkeypatch.setattr("mhar_lightning.eval.evaluate.evaluate_tokens", never)
    evaluate = ["evaluate", str(checkpoint), "--data", str(data), "--no-progress"]
    for size in ("0", "-1"):
        line = refused([*evaluate, "--batch-size", size], capsys)
        assert line == f"mhar evaluate: error: --batch-size {size}: read at least one window per forward"
    out = tmp_path
    line = refused([*evaluate, "--out", str(out)], capsys)
    assert line == f"mhar evaluate: error: --out {out} is a folder: pass a file path, e.g. {out / 'evaluate.json'}"


@pytest.mark.parametrize(
    "options, message",
    [
        (["--max-new-tokens", "-5"], "max_new_tokens must be 0 or more, got -5"),
        (["--top-k", "0"], "top_k must be 1 or more (the likeliest tokens kept), got 0"),
        (["--top-k", "-3"], "top_k must be 1 or more (the likeliest tokens kept), got -3"),
        (["--top-p", "0"], "top_p must be in (0, 1] (the probability mass kept), got 0.0"),
        (["--top-p", "1.5"], "top_p must be in (0, 1] (the probability mass kept), got 1.5"),
        (["--temperature", "-1"], "temperature must be 0 (greedy) or more, got -1.0"),
        (["--temperature", "nan"], "temperature must be 0 (greedy) or more, got nan"),
        (["--device", "cuda:99"], "device 'cuda:99' is not available: this machine has "),
        (["--device", "gpu"], "unknown device 'gpu': use cpu, cuda or cuda:N"),
        (["--prompt", "x" * 100], "the prompt has 100 tokens; the model reads at most 16: shorten it"),
    ],
)
def test_cli_generate_refuses_bad_options_before_printing(run, capsys, options, message):
    checkpoint, _ = run
    line = refused(["generate", str(checkpoint), "--prompt", "ab", *options], capsys)
    assert line.startswith(f"mhar generate: error: {message}")


def test_a_folder_that_is_no_checkpoint_says_so(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    line = refused(["generate", str(tmp_path / "empty"), "--prompt", "x"], capsys)
    assert line == (
        f"mhar generate: error: {tmp_path / 'empty'} is a folder without mhar_config.json, so not a checkpoint: pass a "
        ".ckpt file, a consolidated checkpoint or a converted directory"
    )
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    hf = tmp_path / "hf"
    line = refused(["evaluate", str(hf), "--data", str(tmp_path)], capsys)
    assert line.endswith(f"a Hugging Face model, so convert it first with `mhar convert-hf {hf} OUT` and pass OUT")


def test_cli_evaluate_writes_table_and_json(run, tmp_path, capsys):
    checkpoint, data = run
    out = tmp_path / "scores.json"
    with pytest.raises(SystemExit) as done:
        mhar(["evaluate", str(checkpoint), "--data", str(data), "--out", str(out), "--no-progress"])
    assert done.value.code == 0
    assert "bits per byte" in capsys.readouterr().out
    record = json.loads(out.read_text())
    loaded = load_model(checkpoint, device="cpu")
    stream = TokenStream(data, "val", loaded.tokenizer)
    tokens = stream[0 : len(stream)].tolist()
    expected = reference_loss(loaded.model, tokens, 0, loaded.model.config.max_seq_len)
    assert record["tokens"] == len(tokens)
    assert record["loss_sum"] == pytest.approx(expected, rel=1e-5)
    assert record["perplexity"] == pytest.approx(math.exp(expected / len(tokens)), rel=1e-5)
    assert record["bytes"] == sum(t != 0 for t in tokens)


def test_cli_generate_streams_greedy_tokens(run, capsys):
    checkpoint, _ = run
    with pytest.raises(SystemExit) as done:
        mhar(["generate", str(checkpoint), "--prompt", "The quick", "--max-new-tokens", "20", "--temperature", "0"])
    assert done.value.code == 0
    model = load_model(checkpoint, device="cpu").model
    ids = list(b"The quick")
    while len(ids) < model.config.max_seq_len and ids[-1] != 0:  # up to the model's length or end-of-text
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert capsys.readouterr().out == ByteTokenizer().decode([t for t in ids if t != 0]) + "\n"


def test_cli_generate_says_that_it_stopped_at_the_models_context(run, capsys):
    checkpoint, _ = run
    model = load_model(checkpoint, device="cpu").model
    ids = list(b"The quick")
    while len(ids) < model.config.max_seq_len:
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert 0 not in ids, "greedy decoding ends the text before the context is full: choose another prompt"
    with pytest.raises(SystemExit) as done:
        mhar(["generate", str(checkpoint), "--prompt", "The quick", "--max-new-tokens", "20", "--temperature", "0"])
    out, err = capsys.readouterr()
    assert done.value.code == 0 and out == ByteTokenizer().decode(ids) + "\n"
    assert err.strip() == (
        "mhar generate: stopped after 7 of --max-new-tokens 20 tokens: the prompt (9 tokens) and the continuation"
        " fill the model's context of 16 tokens"
    )
    with pytest.raises(SystemExit):
        mhar(["generate", str(checkpoint), "--prompt", "The quick", "--max-new-tokens", "7", "--temperature", "0"])
    assert capsys.readouterr().err == ""


def test_cli_errors_are_one_line(run, tmp_path, capsys):
    checkpoint, data = run
    line = refused(["evaluate", str(tmp_path / "missing.ckpt"), "--data", str(data)], capsys)
    assert line.startswith("mhar evaluate: error: checkpoint")
    with pytest.raises(SystemExit) as done:
        mhar(["evaluate", str(checkpoint), "--data", str(data), "--split", "test"])
    assert done.value.code == 2 and "has no 'test' split" in capsys.readouterr().err
    (tmp_path / "sharded").mkdir()
    (tmp_path / "sharded" / "meta.pt").write_bytes(b"")
    with pytest.raises(SystemExit):
        mhar(["generate", str(tmp_path / "sharded"), "--prompt", "x"])
    assert "mhar consolidate" in capsys.readouterr().err
