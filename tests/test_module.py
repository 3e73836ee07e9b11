"""`LanguageModel` against independent references: FLOPs formula, clipping, validation loss, perplexity and bits per
byte, eager autograd."""

import math
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from mhar_lightning.kernels import ENV_BACKEND
from torch import nn

from mhar_lightning import module
from mhar_lightning.data import TokenDataModule
from mhar_lightning.module import LanguageModel

MHAR = {"class_path": "mhar_lightning.residual.MHAR", "init_args": {"heads": 4, "blocks": 2}}
pytestmark = pytest.mark.usefixtures("default_corpus")  # tiny_data() reads the default corpus


def tiny_model(**kwargs) -> LanguageModel:
    torch.manual_seed(0)
    model = LanguageModel(preset="tiny", residual=MHAR, vocab_size=256, seq_len=16, **kwargs)
    model.configure_model()
    return model


def tiny_data() -> TokenDataModule:
    return TokenDataModule(tokenizer="byte", seq_len=16, batch_size=4, val_samples=8)


def trainer(tmp_path, **kwargs) -> L.Trainer:
    """A quiet single-CPU trainer; `kwargs` override its settings."""
    quiet = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return L.Trainer(
        **{
            "accelerator": "cpu",
            "devices": 1,
            "use_distributed_sampler": False,
            "default_root_dir": tmp_path,
            **quiet,
            **kwargs,
        }
    )


def test_flops_per_batch_is_six_matmul_params_plus_attention() -> None:
    model = tiny_model()
    batch = torch.randint(0, 256, (3, 17))
    model.training_step(batch, 0)
    matmul_params = sum(m.weight.numel() for m in model.decoder.modules() if isinstance(m, nn.Linear))
    cfg = model.model_config
    per_token = 6 * matmul_params + 12 * cfg.n_layers * cfg.d_model * 16
    assert model.flops_per_batch == per_token * 3 * 16


def test_gradients_are_clipped_to_the_global_norm() -> None:
    model = tiny_model(grad_clip=0.5)
    params = list(model.decoder.parameters())
    for p in params:
        p.grad = torch.full_like(p, 3.0)
    model.on_before_optimizer_step(None)
    assert torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])).item() == pytest.approx(0.5, rel=1e-5)


def test_validation_loss_and_perplexity_match_full_logits(tmp_path) -> None:
    model, data = tiny_model(), tiny_data()
    metrics = trainer(tmp_path).validate(model, datamodule=data, verbose=False)[0]
    data.setup("validate")
    windows = torch.stack([data.val_dataset[i] for i in range(len(data.val_dataset))])
    with torch.no_grad():
        logits = model.decoder(windows[:, :-1])
    targets = windows[:, 1:].flatten()
    nats = F.cross_entropy(logits.flatten(0, 1), targets, reduction="none")
    want = nats.mean().item()
    assert metrics["val/loss"] == pytest.approx(want, rel=1e-5)
    assert metrics["val/ppl"] == pytest.approx(math.exp(want), rel=1e-5)
    text = targets != data.tokenizer.eot_id  # every byte token stands for one byte, end-of-text for none
    assert metrics["val/bpb"] == pytest.approx(nats[text].sum().item() / math.log(2) / text.sum().item(), rel=1e-5)


def test_bf16_mixed_trains_with_fp32_weights(tmp_path) -> None:
    model = tiny_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer(tmp_path, precision="bf16-mixed", max_steps=2, limit_val_batches=0).fit(model, datamodule=tiny_data())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert math.isfinite(float(model.trainer.callback_metrics["train/loss"]))
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())


def test_checkpoint_rebuilds_the_same_model(tmp_path) -> None:
    model = tiny_model()
    fit = trainer(tmp_path, max_steps=1, limit_val_batches=0)
    fit.fit(model, datamodule=tiny_data())
    fit.save_checkpoint(tmp_path / "m.ckpt")
    loaded = LanguageModel.load_from_checkpoint(tmp_path / "m.ckpt")
    tokens = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(loaded(tokens), model(tokens), rtol=0, atol=0)
    assert type(loaded.residual) is type(model.residual) and loaded.residual.heads == 4


class GradientRecorder(L.Callback):
    """Keeps a copy of every parameter's gradient as the optimizer is about to step."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters()}


@pytest.mark.parametrize("release", [(2, 11), (2, 12)])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_compiled_autograd_under_ddp_on_gpus_is_refused_where_torch_crashed(monkeypatch, release, device) -> None:
    """On two H200s torch 2.11 crashed in DDP's compiled gradient hook and left the ranks hung: that combination gets
    a one-line error at setup (and `auto` turns compiled autograd off), while DDP on CPUs (which passed with 2.11 and
    2.13) and later torch releases run it."""
    monkeypatch.setattr(module, "torch_release", lambda: release)
    ddp = DDPStrategy(parallel_devices=[torch.device(device, 0), torch.device(device, 1)])
    run = SimpleNamespace(strategy=ddp, world_size=2)
    supported = not (device == "cuda" and release < module.DDP_GPU_COMPILED_AUTOGRAD_SINCE)
    if supported:
        tiny_model(compiled_autograd=True).check_strategy(run)
    else:
        with pytest.raises(
            ValueError,
            match=r"^compiled_autograd=true is refused: under DDP on GPUs it crashed with torch 2.11 .*"
            r"set model.compiled_autograd=false$",
        ):
            tiny_model(compiled_autograd=True).check_strategy(run)
    tiny_model(compiled_autograd=False).check_strategy(run)
    auto = tiny_model(compiled_autograd="auto")
    auto.check_strategy(run)
    assert auto.compiled_autograd is supported


def test_compiled_autograd_gives_eager_gradients(tmp_path, monkeypatch) -> None:
    """A training step with its backward captured by compiled autograd gives eager autograd's gradients (the
    embedding's summed over the routing calls that read it). One layer, 16 tokens (the interpreter runs the fused
    routing op a row at a time; the reference op is many nodes to trace), and the captured graphs run as traced,
    not through Inductor: capture is slow on a CPU. On a machine with a GPU the step runs there, as the interpreter
    is off."""
    combo = []  # Inductor's combo-kernel option as each captured graph is compiled: on, the kit's default

    def compile_as_traced(graph, inputs):
        combo.append(torch._inductor.config.combo_kernels)
        return graph

    monkeypatch.setattr(torch._inductor, "compile", compile_as_traced)
    monkeypatch.setenv(ENV_BACKEND, "triton")
    grads = []
    for compiled in (False, True):
        model = tiny_model(compiled_autograd=compiled, model_overrides={"n_layers": 1})
        recorder = GradientRecorder()
        accelerator = "gpu" if torch.cuda.is_available() else "cpu"
        run = trainer(tmp_path, accelerator=accelerator, max_steps=1, limit_val_batches=0, callbacks=[recorder])
        run.fit(model, datamodule=TokenDataModule(tokenizer="byte", seq_len=8, batch_size=2, val_samples=8))
        grads.append(recorder.grads)
    assert torch._dynamo.utils.counters["compiled_autograd"]["compiles"] > 0  # the backward was captured
    assert combo and all(combo)
    for name, eager in grads[0].items():
        torch.testing.assert_close(grads[1][name], eager, rtol=1e-5, atol=1e-7, msg=name)
