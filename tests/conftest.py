"""Shared fixtures: tiny random models written in HF format, and the real default target."""

from __future__ import annotations

import ctypes
import gc
import os
import sys
import threading
from pathlib import Path

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

# Engines here run the eager forward unless a test asks for `compile`: inductor takes about a
# minute per process. `DSPARK_COMPILE=1 make test` runs the whole suite compiled.
os.environ.setdefault("DSPARK_COMPILE", "0")
# pytest-xdist's workers share the cores: each takes its share of intra-op threads, or two
# OpenMP pools spin against each other.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def _libc_trim():
    """glibc's malloc_trim, or None off glibc."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _libc_trim()


def pytest_collection_finish(session):
    """Everything imported so far lives for the whole session: freeze it, so the full collections
    after each module (below) walk only the objects the tests made."""
    gc.collect()
    gc.freeze()


def _stop_ray() -> None:
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


_KERNEL_BUILD = pytest.StashKey[threading.Thread]()


def pytest_sessionstart(session):
    """On the xdist controller (its `dsession` plugin), which only hands out work, start building
    the CPU attention kernel at once. Otherwise the first test to need it builds it (25-90 s) on its
    worker, or waits for a served engine's background build at low priority while the other worker
    keeps both cores busy; workers wait on the build's lock as they would on another worker's."""
    if session.config.pluginmanager.hasplugin("dsession"):
        from dspark.models import cpu_attention

        build = session.stash[_KERNEL_BUILD] = threading.Thread(
            target=cpu_attention.build_deferred, name="kernel build"
        )
        build.start()


def pytest_sessionfinish(session):
    """A short run waits for the kernel build it started rather than leave the compiler running."""
    if build := session.stash.get(_KERNEL_BUILD, None):
        build.join()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, with real-server files serialized and long files first (see xdist_schedule)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from tests.xdist_schedule import SuiteScheduling

    return SuiteScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """The scheduler reads `real_server` and `long` from each file's one-line `pytestmark`: refuse
    a marker it cannot see there (on one test, or a `pytestmark` spread over lines)."""
    from tests.xdist_schedule import SCHEDULING_MARKS, file_marks

    for item in items:
        marked = {m for m in SCHEDULING_MARKS if item.get_closest_marker(m)}
        if marked != file_marks(item.path):
            raise pytest.UsageError(
                f"{item.nodeid}: marked {sorted(marked)}, but its file's one-line pytestmark names "
                f"{sorted(file_marks(item.path))}; the scheduler reads only that line"
            )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a module's last test (its module fixtures are torn down by then), free what they held.

    Engines sit in reference cycles, which only a full collection frees, and with torch imported
    those run rarely; glibc keeps freed heap pages in its arenas until trimmed. An xdist worker
    runs dozens of modules: without this, what each one left stayed resident for the session.
    """
    result = yield
    if item.get_closest_marker("real_server") and not (
        nextitem and nextitem.get_closest_marker("real_server")
    ):
        _stop_ray()  # the real-server files share one Ray (see xdist_schedule); the rest need none
    if nextitem is None or nextitem.path != item.path:
        gc.collect()
        if _MALLOC_TRIM is not None:
            _MALLOC_TRIM(0)
    return result


TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def write_tiny_model(path: Path, family: str, seed: int = 0, **overrides) -> Path:
    """A random HF checkpoint of the given family, with weights large enough for peaked logits."""
    torch.manual_seed(seed)
    kwargs = {**TINY, "initializer_range": 0.3, **overrides}
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kwargs, rope_theta=10000.0))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**kwargs))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**kwargs, head_dim=16))
    else:
        raise ValueError(family)
    with torch.no_grad():  # random norms and biases, so a missed weight cannot pass unnoticed
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {f: write_tiny_model(root / f, f) for f in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    from dspark.models.pull import pull_model

    return pull_model("smollm2-135m", progress=False)


@pytest.fixture(scope="module")
def smollm_engine_fp32(smollm_dir):
    from dspark.drafters.ngram import NgramDrafter
    from transformers import AutoTokenizer

    from tests.engine.helpers import engine_on

    return engine_on(smollm_dir, NgramDrafter(4), "static:4", AutoTokenizer.from_pretrained(smollm_dir))
