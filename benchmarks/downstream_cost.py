"""What `DownstreamTasks` costs on the CPU demo, in training steps: CPU time of scoring the shipped tasks against that
of the demo's training steps, alternating in one process (so a busy machine slows both alike).

    python benchmarks/downstream_cost.py                       # one thread, batch 32, three repetitions
    python benchmarks/downstream_cost.py --threads 2 --batch-size 128
"""

import argparse
import statistics
import time

import torch

from mhar_lightning.data.tokenizer import load_tokenizer
from mhar_lightning.downstream import SHIPPED, load_task, task_accuracy
from mhar_lightning.module import LanguageModel

DEMO_RESIDUAL = {"class_path": "mhar_lightning.residual.MHAR", "init_args": {"heads": 4, "blocks": None}}
DEMO_BATCH, DEMO_SEQ, DEMO_VAL_INTERVAL = 16, 128, 150


def cpu_seconds(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32, help="DownstreamTasks' batch_size")
    parser.add_argument("--steps", type=int, default=10, help="training steps timed per repetition")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    module = LanguageModel(preset="tiny", residual=DEMO_RESIDUAL, vocab_size=256, seq_len=DEMO_SEQ)
    module.configure_model()
    decoder, tokenizer = module.decoder, load_tokenizer("byte")
    optimizer = torch.optim.AdamW(decoder.parameters(), lr=3e-3)
    tasks = [load_task(name) for name in SHIPPED]
    batch = torch.randint(0, 256, (DEMO_BATCH, DEMO_SEQ + 1))

    def train() -> None:
        decoder.train()
        for _ in range(args.steps):
            optimizer.zero_grad()
            module.loss(batch).backward()
            optimizer.step()

    def score() -> None:
        decoder.eval()
        for task in tasks:
            task_accuracy(decoder, tokenizer, task, args.batch_size, DEMO_SEQ)

    ratios = []
    for rep in range(args.reps):
        step = cpu_seconds(train) / args.steps
        scoring = cpu_seconds(score)
        ratios.append(scoring / step)
        print(f"rep {rep}: {step:.3f} s CPU per training step, {scoring:.2f} s per scoring = {ratios[-1]:.1f} steps")
    median = statistics.median(ratios)
    print(
        f"median {median:.1f} steps: +{median / DEMO_VAL_INTERVAL:.1%} at a validation every {DEMO_VAL_INTERVAL} steps"
    )


if __name__ == "__main__":
    main()
