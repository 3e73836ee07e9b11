"""A tiny training run for the multi-process tests: `python tests/fsdp_run.py --out DIR ...`.

Start one process per rank with `LOCAL_RANK` set, as torchrun does (`fsdp_helpers.run_ranks`); started alone,
Lightning starts the other ranks itself.

Writes each rank's per-step losses to `OUT/losses-rank{r}.jsonl`, `OUT/shards-rank{r}.json` (local vs global
parameter elements), the first optimizer step's gradients to `OUT/first-grads.pt` and, at the end, the all-gathered
weights to `OUT/gathered.pt`. `--kill-at` ends every rank abruptly after that step, as a pre-emption would.
`--probe-every N` adds the depth-attention probe, whose maps land in `OUT/depth_attention/`.
`--inf-loss-at STEP` makes the loss of rank 1 alone infinite at that step (its gradients stay finite).

`run(argv)` trains in the calling process: the multi-process tests take their one-process references so.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from mhar_lightning.callbacks import DepthAttentionLogger, FinalStepCheckpoint, SameWorldSize
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)

from mhar_lightning.data import TokenDataModule
from mhar_lightning.module import LanguageModel
from mhar_lightning.parallel import full_tensor


class Record(L.Callback):
    """Append (step, loss) per rank; optionally die hard after `kill_at` steps."""

    def __init__(self, out: Path, kill_at: int | None) -> None:
        self.out, self.kill_at = out, kill_at

    def on_train_start(self, trainer: L.Trainer, module: LanguageModel) -> None:
        local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in module.parameters())
        total = sum(p.numel() for p in module.parameters())
        (self.out / f"shards-rank{trainer.global_rank}.json").write_text(json.dumps({"local": local, "total": total}))

    def on_train_end(self, trainer: L.Trainer, module: LanguageModel) -> None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(module, options=options)  # collective: all-gathers every shard
        if trainer.global_rank == 0:
            torch.save(state, self.out / "gathered.pt")

    def on_before_optimizer_step(self, trainer: L.Trainer, module: LanguageModel, optimizer) -> None:
        if trainer.global_step == 0:  # the first step's reduced gradients, whole (a collective under FSDP2)
            grads = {n: full_tensor(p.grad) for n, p in module.named_parameters()}
            if trainer.global_rank == 0:
                torch.save({n: g.float().cpu() for n, g in grads.items()}, self.out / "first-grads.pt")

    def on_train_batch_end(self, trainer: L.Trainer, module: LanguageModel, outputs, batch, batch_idx: int) -> None:
        with open(self.out / f"losses-rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps({"step": trainer.global_step, "loss": outputs["loss"].item()}) + "\n")
        if trainer.global_step == self.kill_at:
            os._exit(17)


def run(argv: list[str] | None = None) -> None:
    """Train as the command line `argv` (default: this process's) asks."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--init", help="converted checkpoint directory with the initial weights (default: random init)")
    parser.add_argument(
        "--residual", default='{"class_path": "mhar_lightning.residual.MHAR", "init_args": {"heads": 4, "blocks": 4}}'
    )
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument(
        "--replicas", type=int, default=1, help="HSDP replica groups (ModelParallelStrategy's data_parallel_size)"
    )
    parser.add_argument("--batch", type=int, default=4, help="per rank")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--ckpt-every", type=int, default=0)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--resume", help="checkpoint path or 'last'")
    parser.add_argument("--activation-checkpointing", default="none")
    parser.add_argument("--untied", action="store_true")
    parser.add_argument("--probe-every", type=int, default=0, help="depth-attention probe every N steps (0: off)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument(
        "--compiled-autograd",
        action="store_true",
        help="capture each backward with compiled autograd; on a CPU its graphs run as traced (Inductor is slow there)",
    )
    parser.add_argument("--compile", action="store_true", help="torch.compile each block (Inductor)")
    parser.add_argument("--inf-loss-at", type=int, help="make rank 1's loss infinite at this (1-based) step")
    parser.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--param-dtype", default="float32", help="FSDP2 compute dtype of the parameters")
    parser.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw", help="model.optimizer.name")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.compiled_autograd and args.accelerator == "cpu":
        torch._inductor.compile = lambda graph, inputs: graph

    L.seed_everything(0)
    module = LanguageModel(
        preset="tiny",
        residual=json.loads(args.residual),
        seq_len=32,
        model_overrides={"tie_embeddings": not args.untied, "n_layers": args.layers},
        optimizer={"name": args.optimizer, "lr": 3e-3, "warmup_steps": 2},
        init_from=args.init,
        activation_checkpointing=args.activation_checkpointing,
        param_dtype=args.param_dtype,
        compile=args.compile,
        compiled_autograd=args.compiled_autograd,
    )
    if args.inf_loss_at:
        loss = module.loss

        def loss_inf_on_rank1(batch: torch.Tensor) -> torch.Tensor:
            value = loss(batch)
            if module.global_rank == 1 and module.trainer.global_step + 1 == args.inf_loss_at:
                value = value + torch.tensor(float("inf"))  # a constant: the gradients are unchanged
            return value

        module.loss = loss_inf_on_rank1
    data = TokenDataModule(
        args.data,
        tokenizer="byte",
        seq_len=32,
        batch_size=args.batch,
        samples_per_epoch=512,
        val_samples=None,
        verify_checksums=False,
    )
    callbacks = [Record(args.out, args.kill_at), SameWorldSize()]
    if args.probe_every:
        callbacks.append(DepthAttentionLogger(every_n_steps=args.probe_every))
    if args.ckpt_every:
        callbacks.append(
            FinalStepCheckpoint(dirpath=args.out / "ckpt", every_n_train_steps=args.ckpt_every, save_last="link")
        )
    strategy = (
        ModelParallelStrategy(data_parallel_size=args.replicas, tensor_parallel_size=args.devices // args.replicas)
        if args.fsdp
        else "auto"
    )
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        default_root_dir=args.out,
        strategy=strategy,
        max_steps=args.steps,
        accumulate_grad_batches=args.accumulate,
        use_distributed_sampler=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(args.ckpt_every),
        callbacks=callbacks,
    )
    trainer.fit(module, datamodule=data, ckpt_path=args.resume)


def main() -> None:
    torch.set_num_threads(1)
    run()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # Skip interpreter teardown, where 2 of 57 runs under load aborted ("terminate called without an active
    # exception", no Python frame left) after every output had been written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
