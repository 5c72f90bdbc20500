"""The CPU path needs no triton: a user's `pip install -e .` does not install it.

Every module that does not itself import triton at module level must import with triton
made unimportable (a meta-path finder that refuses it), and engines with every speculative
algorithm must generate on the CPU that way: plain, NGRAM, STANDALONE, EAGLE-2, EAGLE-3 and
MTP. Both run in a fresh interpreter, since this one may have triton loaded already.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.unit import perfect_draft as pd

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "specserve"

BLOCK_TRITON = """
import importlib.abc, sys

class _NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None

sys.meta_path.insert(0, _NoTriton())
"""


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports_triton_at_top(path: Path) -> bool:
    for node in ast.parse(path.read_text()).body:
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if any(n == "triton" or n.startswith("triton.") for n in names):
            return True
    return False


def kernel_modules() -> set[str]:
    """The modules that are Triton kernels themselves: imported only on the GPU path."""
    return {_module_name(p) for p in PACKAGE.rglob("*.py") if _imports_triton_at_top(p)}


def _run(script: str, args: list[str] = (), timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, also on a GPU machine
    return subprocess.run([sys.executable, "-c", BLOCK_TRITON + script, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_the_blocker_blocks():
    out = _run("import triton")
    assert out.returncode != 0 and "blocked by the test" in out.stderr


def test_every_module_but_the_kernels_imports_without_triton():
    kernels = kernel_modules()
    assert kernels, "the AST scan found no Triton kernel module: the scan is broken"
    names = sorted(_module_name(p) for p in PACKAGE.rglob("*.py"))
    wanted = [n for n in names if n not in kernels]
    script = ("import importlib, json\nfailed = {}\n"
              f"for name in {wanted!r}:\n"
              "    try:\n        importlib.import_module(name)\n"
              "    except Exception as e:\n        failed[name] = f'{type(e).__name__}: {e}'\n"
              "print(json.dumps(failed))\n")
    out = _run(script)
    assert out.returncode == 0, out.stderr[-3000:]
    failed = json.loads(out.stdout.strip().splitlines()[-1])
    assert failed == {}


ENGINE_SCRIPT = """
import json, sys
from specserve import Engine
tokenizer, jobs = sys.argv[1], json.loads(sys.argv[2])
results = []
for target, flags in jobs:
    engine = Engine(target, tokenizer_path=tokenizer, log_level="warning", **flags)
    outs = engine.generate(input_ids=[[5, 6, 7, 8], [9, 10, 11]],
                           sampling_params={"temperature": 0, "max_new_tokens": 8})
    engine.scheduler.kv.flush_cache()
    engine.scheduler.kv.assert_no_leak()
    results.append([o["output_ids"] for o in outs])
print(json.dumps(results))
"""

_TREE = {"speculative_num_steps": 2, "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 4}


def test_engines_generate_on_the_cpu_without_triton(tmp_path, smollm2_dir):
    """Plain decoding and every algorithm (trees, perfect drafts) on the CPU, triton blocked:
    each speculative output equals plain decoding's on the same target."""
    target = pd.make_target(tmp_path / "target")
    target3 = pd.make_target(tmp_path / "target3", eagle3=True)
    mtp = pd.perfect_mtp_deepseek(pd.make_target(tmp_path / "mtp"))
    eagle2 = pd.perfect_eagle2(tmp_path / "eagle2", target)
    eagle3 = pd.perfect_eagle3(tmp_path / "eagle3", target3)
    jobs = [(target, {}), (target3, {}), (mtp, {}),
            (target, {"speculative_algorithm": "NGRAM"}),
            (target, {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": target, **_TREE}),
            (target, {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": eagle2, **_TREE}),
            (target3, {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": eagle3, **_TREE}),
            (mtp, {"speculative_algorithm": "EAGLE", **_TREE})]
    jobs = [(str(t), {k: str(v) if isinstance(v, Path) else v for k, v in f.items()}) for t, f in jobs]
    out = _run(ENGINE_SCRIPT, args=[str(smollm2_dir), json.dumps(jobs)])
    assert out.returncode == 0, out.stderr[-3000:]
    plain_t, plain_t3, plain_mtp, *spec = json.loads(out.stdout.strip().splitlines()[-1])
    assert spec == [plain_t, plain_t, plain_t, plain_t3, plain_mtp]
