"""The lm-evaluation-harness model `mhar`: log-likelihoods against the model's own logits, rolling log-likelihood
against `mhar evaluate`, generation against the kit's greedy decoding, and a local task end to end."""

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="mhar-datasets-"))
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from mhar_lightning.cli import main as mhar  # noqa: E402
from mhar_lightning.data.shards import TokenStream  # noqa: E402
from mhar_lightning.data.token_bytes import token_bytes  # noqa: E402
from mhar_lightning.eval import MharLM  # noqa: E402
from mhar_lightning.eval.evaluate import evaluate_tokens  # noqa: E402
from mhar_lightning.eval.generate import generate  # noqa: E402

TASKS = Path(__file__).parent / "lm_eval_tasks"


@pytest.fixture(scope="module")
def run(trained_mhar_run):
    return trained_mhar_run  # (last.ckpt, prepared data) of a two-step MHAR fit, shared with the other eval tests


def request(kind: str, *args) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def test_loglikelihood_sums_the_continuation_log_probabilities(run):
    checkpoint, _ = run
    lm = MharLM(str(checkpoint), device="cpu", batch_size=2)
    model = lm.model
    pairs = [("The quick", " brown fox"), ("x", "y"), ("def add(a, b): return a + b", " # a longer tail"), ("", "ab")]
    results = lm.loglikelihood([request("loglikelihood", *pair) for pair in pairs])
    for (context, continuation), (logprob, greedy) in zip(pairs, results, strict=True):
        ids = list((context + continuation).encode()) if context else [0, *continuation.encode()]
        n = len(continuation.encode())
        inputs = ids[:-1][-model.config.max_seq_len :]  # contexts longer than the model are cut from the left
        logprobs = torch.log_softmax(model.double()(torch.tensor([inputs]))[0], -1)[-n:]
        targets = torch.tensor(ids[-n:])
        assert logprob == pytest.approx(float(logprobs.gather(-1, targets[:, None]).sum()), rel=1e-5)
        assert greedy == bool((logprobs.argmax(-1) == targets).all())


def test_loglikelihood_rolling_equals_evaluate_total_loss(run):
    checkpoint, data = run
    lm = MharLM(str(checkpoint), device="cpu")
    stream = TokenStream(data, "val", lm.tok)
    tokens = stream[0 : len(stream)]
    assert len(tokens) % lm.max_length  # a last partial window is exercised
    (rolling,) = lm.loglikelihood_rolling([request("loglikelihood_rolling", lm.tok.decode(tokens.tolist()))])
    scores = evaluate_tokens(lm.model, tokens, lm.eot_token_id, token_bytes(lm.tok, 256), progress=False)
    assert -rolling == pytest.approx(scores.loss_sum, rel=1e-6)


def test_generate_until_stops_at_the_first_stop_string(run):
    checkpoint, _ = run
    lm = MharLM(str(checkpoint), device="cpu")
    greedy = lm.tok.decode(list(generate(lm.model, list(b"The quick"), 6)))
    (text,) = lm.generate_until([request("generate_until", "The quick", {"until": ["\n"], "max_gen_toks": 6})])
    assert text == greedy.split("\n")[0].split("\x00")[0]
    stop = greedy[2:4]
    (text,) = lm.generate_until([request("generate_until", "The quick", {"until": [stop], "max_gen_toks": 6})])
    assert text == greedy.split(stop)[0]


def test_generate_until_keeps_the_context_that_fits_beside_max_gen_toks(run):
    """Like lm-eval's Hugging Face model, the context is cut from the left to leave `max_gen_toks` of room; when that
    is the whole model or more (where lm-eval's model refuses), the last context token is kept and as many tokens are
    generated as fit."""
    checkpoint, _ = run
    lm = MharLM(str(checkpoint), device="cpu")
    length = lm.max_length
    context = "The quick brown fox jumps over the lazy dog"
    assert len(context.encode()) > length
    expected = {}
    for keep in (4, 1):  # greedy, a full forward per token, from the last `keep` context tokens
        ids = list(context.encode())[-keep:]
        while len(ids) < length:
            ids.append(int(lm.model(torch.tensor([ids]))[0, -1].argmax()))
        expected[keep] = lm.tok.decode(ids[keep:]).split("\x00")[0]
    for max_gen_toks, keep in ((length - 4, 4), (length - 1, 1), (length, 1), (length + 24, 1), (256, 1)):
        request_ = request("generate_until", context, {"until": ["never"], "max_gen_toks": max_gen_toks})
        assert lm.generate_until([request_]) == [expected[keep]], max_gen_toks


def test_simple_evaluate_runs_a_local_task_by_model_name(run, monkeypatch):
    checkpoint, _ = run
    monkeypatch.chdir(TASKS)  # the task's data_files path is relative
    results = lm_eval.simple_evaluate(
        model="mhar",
        model_args=f"checkpoint={checkpoint},device=cpu",
        tasks=["mhar_tiny_mc"],
        task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
    )
    accuracy = results["results"]["mhar_tiny_mc"]["acc,none"]
    assert accuracy in (0.0, 1 / 3, 2 / 3, 1.0)


class LocalTasks(TaskManager):
    """lm-eval's task index without lm-eval's own 14,000 tasks, whose indexing takes most of a minute: the command
    finds the local task as before."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **{**kwargs, "include_defaults": False})


@pytest.mark.parametrize(
    "options, message",
    [
        (["--tasks", "nosuch_task"], "unknown task nosuch_task: see `lm-eval ls tasks`, or pass --include-path"),
        (["--tasks", "mhar_tiny_mc,nosuch_task"], "unknown task nosuch_task: "),
        (["--tasks", ""], "--tasks names no task: pass comma-separated task names, e.g. --tasks hellaswag"),
        (["--tasks", " , "], "--tasks names no task: "),
        (["--tasks", "mhar_tiny_mc", "--include-path", "/nonexistent"], "--include-path /nonexistent is not a folder"),
        (["--tasks", "mhar_tiny_mc", "--batch-size", "0"], "--batch-size 0: score at least one request per forward"),
        (["--tasks", "mhar_tiny_mc", "--out", "."], "--out . is a folder: pass a file path, e.g. lm_eval.json"),
    ],
)
def test_cli_lm_eval_refuses_bad_options_in_one_line(run, monkeypatch, capsys, options, message):
    checkpoint, _ = run
    monkeypatch.chdir(TASKS)
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", LocalTasks)
    with pytest.raises(SystemExit) as done:
        mhar(["lm-eval", str(checkpoint), "--include-path", str(TASKS), "--device", "cpu", *options])
    out, err = capsys.readouterr()
    assert done.value.code not in (0, None) and out == ""
    assert err.strip().splitlines() == [err.strip()] and err.startswith(f"mhar lm-eval: error: {message}")


def test_cli_lm_eval_writes_table_and_json(run, tmp_path, monkeypatch, capfd):
    """Run outside a git checkout (a copy of the task folder), git says nothing; the results record the kit's commit."""
    checkpoint, _ = run
    tasks = shutil.copytree(TASKS, tmp_path / "tasks")
    monkeypatch.chdir(tasks)
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", LocalTasks)
    out = tmp_path / "lm_eval.json"
    args = ["lm-eval", str(checkpoint), "--tasks", "mhar_tiny_mc", "--include-path", str(tasks), "--out", str(out)]
    with pytest.raises(SystemExit) as done:
        mhar([*args, "--device", "cpu"])
    assert done.value.code == 0
    printed = capfd.readouterr()  # the file descriptors: what a git child process writes too
    assert "mhar_tiny_mc" in printed.out and "fatal" not in printed.err
    results = json.loads(out.read_text())
    assert "acc,none" in results["results"]["mhar_tiny_mc"]
    kit = subprocess.run(["git", "describe", "--always"], cwd=TASKS, capture_output=True, text=True, check=False)
    assert results["git_hash"] == (kit.stdout.strip() or None)
