"""lm-evaluation-harness on the kit's checkpoints: the `mhar` model (`MharLM`) and `mhar lm-eval CHECKPOINT --tasks`.

`import mhar_lightning.eval` registers the model, so `lm_eval.simple_evaluate(model="mhar",
model_args="checkpoint=PATH", tasks=[...])` works. Needs the optional extra: `pip install "mhar-lightning[eval]"`.
"""

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from unittest import mock

import torch

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as error:
    raise ImportError('lm-evaluation-harness is not installed: pip install "mhar-lightning[eval]"') from error
from rich.console import Console
from rich.table import Table

from mhar_lightning.arguments import ToolParser
from mhar_lightning.downstream.scoring import Pair, continuation_logprobs
from mhar_lightning.eval.generate import generate
from mhar_lightning.eval.loading import load_model


@register_model("mhar")
class MharLM(TemplateLM):
    """A checkpoint (`.ckpt`, consolidated, or converted directory) as an lm-eval language model.

    Log-likelihoods are scored in batches of `batch_size` right-padded rows (padding after a row cannot change its
    causal logits); contexts longer than the model are cut from the left. Generation decodes one request at a time
    with the KV cache, greedy unless `do_sample` (then `temperature`, `top_k`, `top_p` and `seed`), from the context
    that leaves room for `max_gen_toks` (at least its last token).
    """

    def __init__(
        self,
        checkpoint: str,
        tokenizer: str | None = None,
        device: str | None = None,
        dtype: str | None = None,
        batch_size: int | str | None = 8,
        max_batch_size: int | None = None,
        seed: int = 0,
        **_unused,
    ) -> None:
        super().__init__()
        loaded = load_model(checkpoint, tokenizer, device, dtype)
        self.model, self.tok = loaded.model, loaded.tokenizer
        self._device = loaded.device
        auto = batch_size is None or str(batch_size).startswith("auto")  # "auto" and "auto:N" are read as 8, no search
        self.batch_size = 8 if auto else int(batch_size)
        if self.batch_size < 1:
            raise ValueError(f"batch_size {batch_size}: score at least one request per forward, or pass auto")
        self.max_length = self.model.config.max_seq_len
        self.generator = torch.Generator(self._device).manual_seed(int(seed))

    @property
    def eot_token_id(self) -> int:
        return self.tok.eot_id

    @property
    def tokenizer_name(self) -> str:
        return self.tok.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tok.encode(string)

    @torch.inference_mode()
    def score(self, pairs: Sequence[Pair]) -> list[tuple[float, bool]]:
        """(sum of log-probabilities of the continuation, whether greedy decoding produces it) per (context,
        continuation) pair of token lists, longest first in batches."""

        def model(tokens: torch.Tensor) -> torch.Tensor:
            return self.model(tokens.to(self._device))

        return continuation_logprobs(model, pairs, self.batch_size, self.max_length, self.eot_token_id)

    def _loglikelihood_tokens(self, requests, **kwargs) -> list[tuple[float, bool]]:
        results = self.score([(context, continuation) for _, context, continuation in requests])
        for (key, _, _), result in zip(requests, results, strict=True):
            self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole text, in windows of the model's length (the first read after end-of-text)."""
        totals = []
        for (text,) in (request.args for request in requests):
            windows = [
                make_disjoint_window(window)
                for window in get_rolling_token_windows(self.tok_encode(text), self.eot_token_id, self.max_length, 1)
            ]
            totals.append(sum(logprob for logprob, _ in self.score(windows)))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), totals[-1])
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        outputs = []
        for request in requests:
            context, options = request.args
            options = dict(options)
            until = options.pop("until", None) or [self.tok.decode([self.eot_token_id])]
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(options.pop("max_gen_toks", 256))
            sample = options.pop("do_sample", False)
            temperature = float(options.pop("temperature", 1.0 if sample else 0.0)) if sample else 0.0
            keep = self.max_length - min(max_new, self.max_length - 1)  # at least one context token, as much as fits
            prompt = self.tok_encode(context)[-keep:] or [self.eot_token_id]
            ids: list[int] = []
            text = ""
            for token in generate(
                self.model,
                prompt,
                max_new,
                temperature=temperature,
                top_k=options.pop("top_k", None),
                top_p=options.pop("top_p", None),
                generator=self.generator,
                stop=self.eot_token_id,
            ):
                if token == self.eot_token_id:
                    break
                ids.append(token)
                text = self.tok.decode(ids)
                if any(stop in text for stop in until):
                    break
            for stop in until:
                text = text.split(stop)[0]
            outputs.append(text)
            self.cache_hook.add_partial("generate_until", request.args, text)
        return outputs


def results_table(results: dict) -> Table:
    """One row per task and metric of `simple_evaluate`'s results."""
    table = Table(title="lm-evaluation-harness", title_justify="left")
    for column in ("task", "metric", "value", "stderr"):
        table.add_column(column, justify="left" if column in ("task", "metric") else "right")
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            metric, is_metric, _ = key.partition(",")  # "acc,none": a metric and its filter
            if not is_metric or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            stderr = metrics.get(key.replace(metric, f"{metric}_stderr", 1))
            stderr_text = f"{stderr:.4f}" if isinstance(stderr, (int, float)) else ""
            table.add_row(task, metric, f"{value:.4f}", stderr_text)
    return table


def source_commit() -> str | None:
    """The kit's commit (`git describe --always` in its source folder), or None outside a checkout or without git.

    lm-eval records as `git_hash` the commit of the working directory, and lets git print `fatal: not a git
    repository` outside one; `mhar lm-eval` records the kit's instead, quietly."""
    try:
        done = subprocess.run(
            ["git", "describe", "--always"], cwd=Path(__file__).parent, capture_output=True, text=True, check=False
        )
    except OSError:
        return None
    return done.stdout.strip() or None


def main(argv: list[str] | None = None) -> int:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from mhar_lightning.eval.loading import add_model_options

    parser = ToolParser(prog="mhar lm-eval", description=__doc__.splitlines()[0])
    add_model_options(parser)
    parser.add_argument("--tasks", required=True, help="comma-separated task names, e.g. hellaswag,lambada_openai")
    parser.add_argument("--include-path", type=Path, help="a folder of task YAML files (e.g. tasks on local files)")
    parser.add_argument("--num-fewshot", type=int, help="examples in each prompt (default: the task's)")
    parser.add_argument("--limit", type=float, help="only this many documents per task (a fraction if < 1)")
    parser.add_argument("--batch-size", type=int, default=8, help="default: %(default)s")
    parser.add_argument("--out", type=Path, default=Path("lm_eval.json"), help="JSON results (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        tasks = [task.strip() for task in args.tasks.split(",") if task.strip()]
        if not tasks:
            raise ValueError("--tasks names no task: pass comma-separated task names, e.g. --tasks hellaswag")
        if args.include_path and not args.include_path.is_dir():
            raise ValueError(f"--include-path {args.include_path} is not a folder: pass the folder of your task YAML")
        if args.batch_size < 1:
            raise ValueError(f"--batch-size {args.batch_size}: score at least one request per forward")
        if args.out.is_dir():
            raise ValueError(f"--out {args.out} is a folder: pass a file path, e.g. {args.out / 'lm_eval.json'}")
        manager = TaskManager(include_path=[str(args.include_path)] if args.include_path else None)
        unknown = [task for task in tasks if task not in manager.all_tasks]
        if unknown:
            raise ValueError(
                f"unknown task {', '.join(unknown)}: see `lm-eval ls tasks`, or pass --include-path with its YAML"
            )
        model = MharLM(str(args.checkpoint), args.tokenizer, args.device, args.dtype, args.batch_size)
        with mock.patch("lm_eval.evaluator.get_git_commit_hash", source_commit):
            results = simple_evaluate(
                model=model,
                tasks=tasks,
                num_fewshot=args.num_fewshot,
                limit=args.limit,
                task_manager=manager,
                log_samples=False,
            )
    except (ValueError, FileNotFoundError) as error:
        print(f"mhar lm-eval: error: {error}", file=sys.stderr)
        return 1
    Console().print(results_table(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")
    return 0
