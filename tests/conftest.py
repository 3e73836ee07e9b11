"""Test setup: Triton kernels in the CPU interpreter when no GPU is present; every test offline and cache-free."""

import atexit
import os
import shutil
import socket
import tempfile

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_language_once_per_launch() -> None:
    """Triton's interpreter patches `triton.language` again on every call of a nested @jit function (about 1.7 ms a
    call on a 2-core machine: half the interpreted kernels' time), although the launch around it has patched the same
    modules already and restores them when it ends. Skip the repeat; a launch still patches as before."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # no Triton on this platform: the kit routes with the reference op
        return
    patch, scope = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "_LangPatchScope", None)
    if patch is None or scope is None or not tl.core.is_builtin(tl.load):  # another Triton: leave it as it is
        return

    def patched(module) -> bool:
        return not tl.core.is_builtin(module.load)

    def patch_once(fn):
        langs = [v for v in fn.__globals__.values() if v is tl or v is tl.core]
        if langs and all(patched(lang) for lang in langs):
            return scope()
        return patch(fn)

    interpreter._patch_lang = patch_once


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_language_once_per_launch()

torch.set_num_threads(min(2, os.cpu_count() or 1))
# Inductor's on-disk cache does not key on a custom op's fake implementation, so a stale entry could hide a change.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = _inductor_cache = tempfile.mkdtemp(prefix="mhar-inductor-")
atexit.register(shutil.rmtree, _inductor_cache, ignore_errors=True)

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@pytest.fixture(autouse=True)
def offline_env(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point MHAR/tiktoken cache variables at empty temp folders and make any network connection fail."""
    root = tmp_path_factory.mktemp("env")
    for var in ("MHAR_CACHE_DIR", "TIKTOKEN_CACHE_DIR", "MHAR_TIKTOKEN_DIR"):
        monkeypatch.setenv(var, str(root / var.lower()))
    monkeypatch.delenv("DATA_GYM_CACHE_DIR", raising=False)

    connect = socket.socket.connect

    def guarded_connect(sock: socket.socket, address: object) -> None:
        internet = sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in LOOPBACK
        if internet:  # Unix sockets and loopback (dataloader workers, gloo rendezvous) stay usable
            raise AssertionError(f"a test tried to open a network connection to {address}")
        connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", guarded_connect)
