"""The sampled draw's, the sampling filters', the accept walk's and the invariant product's (its L2
prefetch) Triton kernels compile for a Hopper GPU
(hopper_compile.py, in a subprocess without TRITON_INTERPRET), so a kernel that only the
interpreter accepts fails here rather than on the first GPU that runs it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")


def _ptxas_available() -> bool:
    nvidia = Path(triton.__file__).parent / "backends" / "nvidia"
    return (nvidia / "bin" / "ptxas").is_file()


@pytest.mark.skipif(not _ptxas_available(), reason="this triton ships no NVIDIA backend")
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "tests.unit.hopper_compile"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    from tests.unit import hopper_compile  # its list of kernels: compiling is the subprocess's
    assert done.stdout.count("ok ") == len(hopper_compile.KERNELS), done.stdout
