"""The one architectural law (docs/architecture.md): imports go downward only.

LAYERS below is the one list of which package sits where. Every import in specserve/
(including those inside functions and under TYPE_CHECKING) must name a module of the
importer's own layer or a lower one. A new package or top-level module must be placed
here, or this test fails.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "specserve"

LAYERS: dict[str, int] = {
    "specserve.core": 0,        # shared types: config, env, requests, batches, ForwardBatch, messages
    "specserve.kernels": 1,     # Triton kernels (imported lazily) and the switch that picks them
    "specserve.cache": 1,       # KV pool, slot allocator, request table, radix cache
    "specserve.tokenizer": 1,   # tokenizer, chat template, streaming detokenizer, stop strings
    "specserve.grammar": 1,     # grammar constraints: llguidance compile cache, matchers, token masks
    "specserve.models": 2,      # model files, loaders (HF, GGUF, catalogue)
    "specserve.attention": 2,   # attention backends
    "specserve.runner": 3,      # ForwardBatch -> logits/features, CUDA graphs, sampling
    "specserve.engine": 4,      # scheduler, KV manager, overlap, the engine process
    "specserve.spec": 5,        # speculative decoding: registry, worker, proposers
    "specserve.server": 6,      # FastAPI routes, OpenAI protocol
    "specserve.args": 7,        # command line -> Config (SGLang's flags, rules and messages)
    "specserve.args_check": 7,
    "specserve.args_parallel": 7,
    "specserve.preflight": 8,   # entry points: start-up checks, offline Engine, server, CLIs
    "specserve.offline": 8,
    "specserve.launch_server": 8,
    "specserve.follower_node": 8,
    "specserve.frontends": 8,
    "specserve.cli": 8,
    "specserve.bench": 8,
    "specserve.train": 8,
    "specserve": 8,             # the package's __init__ (lazy Engine)
}


def layer_of(module: str) -> int:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in LAYERS:
            return LAYERS[key]
    raise KeyError(f"{module} has no layer: add its package to LAYERS in {__file__}")


def module_of(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) of every specserve import in the file."""
    mod = module_of(path)
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            # `from pkg import mod` imports pkg.mod when mod is a module
            for a in node.names:
                sub = f"{base}.{a.name}"
                is_module = (ROOT.parent / (sub.replace(".", "/") + ".py")).exists() or \
                    (ROOT.parent / sub.replace(".", "/")).is_dir()
                found.append((node.lineno, sub if is_module else base))
    return [(line, m) for line, m in found if m == "specserve" or m.startswith("specserve.")]


def upward_imports() -> list[str]:
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        mod = module_of(path)
        own = layer_of(mod)
        for line, target in imports_of(path):
            if target == "specserve":
                continue  # the package itself (`from specserve import kernels` resolves above)
            if layer_of(target) > own:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: {mod} (layer {own}) imports "
                           f"{target} (layer {layer_of(target)})")
    return bad


def test_every_module_has_a_layer():
    for path in ROOT.rglob("*.py"):
        layer_of(module_of(path))


def test_imports_go_downward_only():
    bad = upward_imports()
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_only_env_py_reads_the_environment():
    """Every environment variable is read in core/env.py (its names, defaults and parsing)."""
    readers = []
    for path in ROOT.rglob("*.py"):
        if path == ROOT / "core" / "env.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and \
                    isinstance(node.value, ast.Name) and node.value.id == "os":
                readers.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    assert not readers, "os.environ read outside core/env.py:\n" + "\n".join(readers)
