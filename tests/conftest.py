"""Test setup: Triton kernels in the CPU interpreter when no GPU is present; every test offline and cache-free, with
the default corpus and short demo runs prepared once per session (shared by pytest-xdist's workers) for the tests
that ask for them."""

import atexit
import os
import shutil
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

# One thread per pytest-xdist worker and per process a test starts (ranks, `mhar` runs), and Inductor compiling in
# the process itself: more threads or a pool of compile workers only contend for the same few cores.
os.environ["OMP_NUM_THREADS"] = "1" if os.environ.get("PYTEST_XDIST_WORKER") else str(min(2, os.cpu_count() or 1))
os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"

import torch  # noqa: E402  (after the thread settings it reads)

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

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# Inductor's on-disk cache does not key on a custom op's fake implementation, so a stale entry could hide a change.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = _inductor_cache = tempfile.mkdtemp(prefix="mhar-inductor-")
atexit.register(shutil.rmtree, _inductor_cache, ignore_errors=True)


def once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    """The folder `name` filled by `make` once for the whole test session: pytest-xdist's workers share it (the first
    to ask makes it while the others wait), so a session fixture built with it is not rebuilt on every worker. Tests
    only read it."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # every worker's base folder lies in the session's
    folder, done = root / name, root / f"{name}.done"
    with FileLock(root / f"{name}.lock"):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            done.touch()
    return folder


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


@pytest.fixture(scope="session")
def stdlib_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache folder (`MHAR_CACHE_DIR`) holding the default corpus, the standard library as byte tokens: prepared once
    a session instead of in every test that trains on it (about 10 MB of text to tokenize)."""
    from mhar_lightning.data.corpus import ensure_corpus
    from mhar_lightning.data.tokenizer import load_tokenizer

    def prepare(root: Path) -> None:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("MHAR_CACHE_DIR", str(root))
            ensure_corpus(load_tokenizer("byte"), progress=False)

    return once(tmp_path_factory, "mhar-cache", prepare)


@pytest.fixture
def default_corpus(stdlib_cache: Path, offline_env: None) -> None:
    """The session's prepared default corpus, linked into this test's otherwise empty cache folder (shards are
    read-only to the kit, and their checksums are verified whenever a data module opens them)."""
    cache = Path(os.environ["MHAR_CACHE_DIR"])
    cache.mkdir(parents=True, exist_ok=True)
    for corpus in stdlib_cache.iterdir():
        (cache / corpus.name).symlink_to(corpus, target_is_directory=True)


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory: pytest.TempPathFactory, stdlib_cache: Path) -> Path:
    """A finished two-step `mhar fit` of the demo recipe (`fast_demo_args`: `checkpoints/last.ckpt` at step 2 and its
    TensorBoard run), for tests that need a trained run to resume, damage or validate: they copy it (`copy_run`)."""
    from cli_helpers import corpus_cache, fast_demo_args

    from mhar_lightning.cli import main

    def train(root: Path) -> None:
        with corpus_cache(stdlib_cache):
            main(fast_demo_args(root, max_steps=2))

    return once(tmp_path_factory, "demo-run", train)


@pytest.fixture(scope="session")
def ddp_demo_run(tmp_path_factory: pytest.TempPathFactory, stdlib_cache: Path) -> Path:
    """`mhar fit` of the demo recipe (`fast_demo_args`, `DDP_STEPS` steps) on 2 DDP processes (gloo, CPU), read by
    the resume test as its uninterrupted run and by the depth-attention test (both ranks probe at the end)."""
    from cli_helpers import DDP_STEPS, corpus_cache, fast_demo_args, run_ddp

    def train(root: Path) -> None:
        with corpus_cache(stdlib_cache):
            run_ddp(fast_demo_args(root, DDP_STEPS))

    return once(tmp_path_factory, "ddp-run", train)


@pytest.fixture(scope="session")
def small_demo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A three-step `mhar fit` of the demo recipe, probes included, on forty standard-library files (`small_corpus`):
    the depth-attention test reads its TensorBoard run and `mhar inspect` its checkpoint."""
    from probe_helpers import demo_fit, small_corpus

    def train(root: Path) -> None:
        demo_fit(root / "run", small_corpus(root / "data"), 3)

    return once(tmp_path_factory, "small-run", train) / "run"


@pytest.fixture(scope="session")
def trained_mhar_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """`eval_helpers.trained_checkpoint` of the demo's MHAR model, (last.ckpt, prepared data), read by the evaluate
    and lm-evaluation-harness tests."""
    from eval_helpers import trained_checkpoint

    root = once(tmp_path_factory, "mhar-run", trained_checkpoint)
    return root / "checkpoints" / "last.ckpt", root / "prepared"


@pytest.fixture
def fresh_compile_caches() -> None:
    """Dynamo's caches emptied before the test, so it compiles its own graphs: blocks whose graphs no longer fit the
    recompile limits run eagerly, and a comparison with eager would then pass without testing anything."""
    torch._dynamo.reset()
