"""The 1b FSDP2 recipe's model on 1 or more GPUs (`--devices`): tokens/s, MFU, peak memory and an exact-resume check.

    python benchmarks/fsdp_1b.py --out DIR --phase full     # steps 1..S, a sharded checkpoint at --ckpt-at
    python benchmarks/fsdp_1b.py --out DIR --phase resume   # a fresh process resumes that checkpoint to S

The model, residual (MHAR, H = 8, 8 blocks), optimizer and strategy are those of recipes/fsdp/pretrain-1b.yaml;
the data are synthetic token sequences (arithmetic progressions modulo the vocabulary, so the loss falls) served
by a `StatefulDataLoader`, so the benchmark needs no prepared corpus. Each phase appends one
JSON line per step (rank 0's loss, seconds) to OUT/<phase>.jsonl and rank 0 a summary to OUT/<phase>-summary.json.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from mhar_lightning.callbacks import FinalStepCheckpoint
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from mhar_lightning.memory_plan import memory_plan
from mhar_lightning.module import LanguageModel
from mhar_lightning.parallel import routing_parameter_count

H200_BF16_PEAK = 989e12  # dense bf16 FLOP/s of an H200 SXM (datasheet), the usual MFU denominator


class Progressions(Dataset):
    """Sample i: `seq_len + 1` tokens `(a + b * t) % vocab` with (a, b) drawn from seed i."""

    def __init__(self, vocab: int, seq_len: int, samples: int) -> None:
        self.vocab, self.seq_len, self.samples = vocab, seq_len, samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(i)
        a, b = torch.randint(self.vocab, (1,), generator=g), torch.randint(1, 97, (1,), generator=g)
        return (a + b * torch.arange(self.seq_len + 1)) % self.vocab


class Data(L.LightningDataModule):
    def __init__(self, vocab: int, seq_len: int, batch: int) -> None:
        super().__init__()
        self.dataset, self.batch = Progressions(vocab, seq_len, 1 << 20), batch

    def train_dataloader(self) -> StatefulDataLoader:
        sampler = StatefulDistributedSampler(self.dataset, self.trainer.world_size, self.trainer.global_rank, seed=0)
        return StatefulDataLoader(self.dataset, batch_size=self.batch, sampler=sampler, num_workers=2, drop_last=True)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Meter(L.Callback):
    """Per-step loss, step time and the gap before the step (a checkpoint save lands there), as JSON lines."""

    def __init__(self, path: Path) -> None:
        self.path, self.start, self.end = path, 0.0, None

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        _sync()
        self.start = time.perf_counter()
        self.gap = None if self.end is None else self.start - self.end

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        _sync()
        self.end = time.perf_counter()
        if not trainer.is_global_zero:
            return
        record = {
            "step": trainer.global_step,
            "loss": outputs["loss"].item(),
            "seconds": self.end - self.start,
            "gap": self.gap,
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--phase", choices=["full", "resume"], required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--ckpt-at", type=int, default=120)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--activation-checkpointing", default="none")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--preset", default="1b", help="tiny for a CPU smoke run")
    parser.add_argument("--accelerator", default="gpu")
    parser.add_argument("--devices", type=int, default=1, help="FSDP2 data-parallel ranks, one process each")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / f"{args.phase}.jsonl"

    L.seed_everything(0)
    residual = {"class_path": "mhar_lightning.residual.MHAR", "init_args": {"heads": 8, "blocks": 8}}
    module = LanguageModel(
        preset=args.preset,
        residual=residual,
        seq_len=args.seq_len,
        optimizer={"lr": 2e-4, "warmup_steps": 20},
        loss_chunk_tokens=8192,
        activation_checkpointing=args.activation_checkpointing,
        compile=args.compile,
    )
    checkpoint = FinalStepCheckpoint(
        dirpath=args.out / "ckpt", every_n_train_steps=args.ckpt_at, save_top_k=-1, save_last="link"
    )
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1),
        precision="32-true",
        max_steps=args.steps,
        use_distributed_sampler=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[Meter(log), checkpoint],
    )
    data = Data(module.model_config.vocab_size, args.seq_len, args.batch)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    resume_from = args.out / "ckpt" / f"epoch=0-step={args.ckpt_at}.ckpt"  # `last` is the full run's final step
    trainer.fit(module, datamodule=data, ckpt_path=resume_from if args.phase == "resume" else None)
    wall = time.perf_counter() - started
    if not trainer.is_global_zero:
        return

    records = [json.loads(line) for line in log.read_text().splitlines()]
    steady = [r["seconds"] for r in records[10:]] or [r["seconds"] for r in records]
    step_s = statistics.median(steady)
    tokens = args.batch * args.seq_len * args.devices
    config = module.model_config
    routing = routing_parameter_count(config, module.residual)
    plan = memory_plan(
        config, args.devices, args.batch, args.seq_len, args.activation_checkpointing, routing, stream_tensors=2
    )
    summary = {
        "phase": args.phase,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "devices": args.devices,
        "compile": args.compile,
        "activation_checkpointing": args.activation_checkpointing,
        "steps_run": len(records),
        "first_step": records[0]["step"],
        "median_step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "mfu": config.flops_per_token(args.seq_len) * tokens / step_s / (H200_BF16_PEAK * args.devices),
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
        "planned_gib": plan.total / 2**30,
        "checkpoint_save_s": next((r["gap"] for r in records if r["step"] == args.ckpt_at + 1), None),
        "wall_s": wall,
        "params": config.num_params() + routing,
    }
    if args.phase == "resume":
        full = {r["step"]: r["loss"] for r in map(json.loads, (args.out / "full.jsonl").read_text().splitlines())}
        diffs = [abs(r["loss"] - full[r["step"]]) for r in records if r["step"] in full]
        summary["resume_first_step"] = records[0]["step"]
        summary["resume_first_loss_equal"] = records[0]["loss"] == full.get(records[0]["step"])
        summary["resume_max_abs_loss_diff"] = max(diffs) if diffs else None
        summary["resume_compared_steps"] = len(diffs)
    (args.out / f"{args.phase}-summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
