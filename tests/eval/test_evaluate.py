"""`mhar evaluate` and `mhar generate` on a trained checkpoint, against losses computed here from the model's logits."""

import json
import math

import numpy as np
import pytest
import torch
from eval_helpers import random_decoder

from mhar_lightning.cli import main as mhar
from mhar_lightning.data.shards import TokenStream
from mhar_lightning.data.tokenizer import ByteTokenizer, load_tokenizer
from mhar_lightning.eval.evaluate import evaluate_tokens, token_bytes
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


def test_cli_errors_are_one_line(run, tmp_path, capsys):
    checkpoint, data = run
    with pytest.raises(SystemExit) as done:
        mhar(["evaluate", str(tmp_path / "missing.ckpt"), "--data", str(data)])
    assert done.value.code == 1
    assert capsys.readouterr().err.startswith("mhar evaluate: error: checkpoint")
    with pytest.raises(SystemExit) as done:
        mhar(["evaluate", str(checkpoint), "--data", str(data), "--split", "test"])
    assert "has no 'test' split" in capsys.readouterr().err
    (tmp_path / "sharded").mkdir()
    (tmp_path / "sharded" / "meta.pt").write_bytes(b"")
    with pytest.raises(SystemExit):
        mhar(["generate", str(tmp_path / "sharded"), "--prompt", "x"])
    assert "mhar consolidate" in capsys.readouterr().err
