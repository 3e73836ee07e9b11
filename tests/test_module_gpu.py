"""The recipes' speed options under `Trainer.fit` on a GPU: compiled blocks, compiled autograd, bf16 autocast and the
fused optimizer give eager's first-step gradients and validation losses and train on (skipped without CUDA)."""

import lightning as L
import pytest
import torch

from mhar_lightning.data import TokenDataModule
from mhar_lightning.module import LanguageModel

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("fresh_compile_caches"),
]


RESIDUALS = {
    "sum": "sum",
    "mhar-block": {"class_path": "mhar_lightning.residual.MHAR", "init_args": {"heads": 4, "blocks": 2}},
    "delta-mhar": {"class_path": "mhar_lightning.residual.DeltaMHAR", "init_args": {"heads": 4, "block_size": 2}},
    "hyper-connections": {"class_path": "mhar_lightning.residual.HyperConnections", "init_args": {"rate": 4}},
}
COMPILED_AUTOGRAD = {"hyper-connections": False}  # as in its recipes: its captured backward compiles too slowly


class FirstGradients(L.Callback):
    """A copy of every parameter's gradient after the first backward, and the losses of every step."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}
        self.losses: list[float] = []

    def on_after_backward(self, trainer, pl_module) -> None:
        if not self.grads:
            self.grads = {n: p.grad.detach().float().clone() for n, p in pl_module.named_parameters()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def trainer_for(tmp_path, steps: int, val_every: int | None, callbacks: list[L.Callback]) -> L.Trainer:
    """A bf16 GPU trainer of `steps` steps, validating 2 batches every `val_every` steps (never if None)."""
    return L.Trainer(
        accelerator="gpu",
        devices=1,
        precision="bf16-mixed",
        max_steps=steps,
        limit_val_batches=0 if val_every is None else 2,
        val_check_interval=val_every,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        default_root_dir=tmp_path,
        callbacks=callbacks,
    )


def data() -> TokenDataModule:
    return TokenDataModule(tokenizer="byte", seq_len=64, batch_size=8, val_samples=8)


def fit(tmp_path, residual, steps: int, val_every: int | None = None, **speed) -> FirstGradients:
    """Train `steps` steps, validating every `val_every` steps if given."""
    torch.manual_seed(0)
    model = LanguageModel(preset="tiny", residual=residual, vocab_size=256, seq_len=64, **speed)
    recorder = FirstGradients()
    trainer_for(tmp_path, steps, val_every, [recorder]).fit(model, datamodule=data())
    return recorder


@pytest.mark.parametrize("name", list(RESIDUALS))
def test_compiled_trainer_step_gives_eager_gradients(tmp_path, name) -> None:
    """Every speed option the strategy's GPU recipes turn on: the first step's gradients match eager ones (bf16
    autocast: relative error of each parameter's gradient), and ten steps with a compiled validation between them
    lower the loss."""
    eager = fit(tmp_path / "eager", RESIDUALS[name], steps=1)
    speed = {"compile": True, "compiled_autograd": COMPILED_AUTOGRAD.get(name, True)}
    fast = fit(tmp_path / "fast", RESIDUALS[name], steps=10, val_every=5, **speed)
    assert eager.grads.keys() == fast.grads.keys()
    total = torch.stack([g.norm() for g in eager.grads.values()]).norm()
    for param, reference in eager.grads.items():  # zero-initialised routing parameters may have zero gradients
        error = (fast.grads[param] - reference).norm() / torch.maximum(reference.norm(), 1e-3 * total)
        assert error < 3e-2, f"{param}: relative gradient error {error:.3g}"
    assert all(map(torch.isfinite, map(torch.tensor, fast.losses)))
    assert fast.losses[-1] < fast.losses[0]


def test_no_host_sync_between_log_steps_and_a_bad_step_is_skipped_on_the_device(tmp_path) -> None:
    """Between log steps a compiled step never waits for the GPU (CUDA's sync debug mode raises on any wait), and
    a step with a non-finite loss is skipped by the fused optimizer on the device, then stops the run by name."""
    from mhar_lightning.errors import TrainingDiverged

    class Watch(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            step = trainer.global_step + 1
            torch.cuda.set_sync_debug_mode("error" if 2 < step and step % 4 not in (0, 1) else "default")
            if step == 7:
                self.before = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
                loss = pl_module.loss  # a NaN that reaches every gradient, as a diverging step's does
                pl_module.loss = lambda batch: loss(batch) * float("nan")

        def on_exception(self, trainer, pl_module, exception) -> None:
            torch.cuda.set_sync_debug_mode("default")  # the Trainer's teardown moves the state to the CPU

    torch.manual_seed(0)
    model = LanguageModel(preset="tiny", residual=RESIDUALS["mhar-block"], vocab_size=256, seq_len=64, compile=True)
    watch = Watch()
    trainer = L.Trainer(
        accelerator="gpu",
        precision="bf16-mixed",
        max_steps=12,
        log_every_n_steps=4,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[watch],
    )
    try:
        with pytest.raises(TrainingDiverged, match=r"^training diverged at step 7: the loss is not finite"):
            trainer.fit(model, datamodule=TokenDataModule(tokenizer="byte", seq_len=64, batch_size=8, val_samples=8))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for name, before in watch.before.items():
        assert torch.equal(dict(model.named_parameters())[name].detach().cpu(), before.cpu()), name


@pytest.mark.parametrize("name", list(RESIDUALS))
def test_compiled_validation_gives_eager_loss(tmp_path, name) -> None:
    """Validation through the compiled blocks (a no-grad graph of their own, compiled after the training graph)
    gives eager's loss, with the routing weights moved off their initialisation, where every strategy equals `sum`."""
    torch.manual_seed(0)
    model = LanguageModel(preset="tiny", residual=RESIDUALS[name], vocab_size=256, seq_len=64, compile=True)
    trainer = trainer_for(tmp_path, steps=2, val_every=2, callbacks=[])
    trainer.fit(model, datamodule=data())
    with torch.no_grad():
        for param in model.decoder.parameters():
            param.add_(torch.randn_like(param), alpha=0.3 if param.abs().max() == 0 else 0.3 * param.std().item())
    compiled = trainer.validate(model, datamodule=data(), verbose=False)[0]["val/loss"]
    with torch.compiler.set_stance("force_eager"):
        eager = trainer.validate(model, datamodule=data(), verbose=False)[0]["val/loss"]
    assert abs(compiled - eager) < 1e-2 * eager, f"compiled validation loss {compiled:.4f}, eager {eager:.4f}"
