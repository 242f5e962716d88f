"""The kernels' build (cpu_kernels/build.py): every variant compiles with -Wall -Werror on any x86
machine, a C error fails loudly instead of falling back in silence, the variant a CPU runs is the
best it can, and no Python file holds C source."""

from __future__ import annotations

import ast
import os
import shutil
from pathlib import Path

import pytest

from kvsnap.cpu_kernels import build

ROOT = Path(__file__).resolve().parents[2]


def test_every_variant_compiles_and_the_cpu_runs_the_best_it_can():
    built = build.compile_all()
    assert set(built) == set(build.buildable()) and all(path is not None for path in built.values()), built
    if build.X86:
        assert set(built) == {"amx", "avx512bf16", "generic"}
    if not build.enabled():  # KVSNAP_C_KERNELS=0: built, and none runs
        assert build.chosen() is None and build.runnable() == []
        return
    runnable = build.runnable()  # those whose instructions this CPU has and that load (AMX: Linux's grant)
    assert runnable and set(runnable) <= {v for v in build.VARIANTS if build.runs_here(v)}
    named = os.environ.get("KVSNAP_KERNEL_VARIANT")
    assert build.chosen() == ((named if named in runnable else None) if named else runnable[0])


@pytest.fixture
def sources(tmp_path, monkeypatch):
    """A copy of the C sources the build reads (and a cache of its own), to break on purpose."""
    csrc = tmp_path / "csrc"
    shutil.copytree(build.CSRC, csrc)
    monkeypatch.setattr(build, "CSRC", csrc)
    monkeypatch.setenv("KVSNAP_KERNEL_DIR", str(tmp_path / "cache"))
    build.compiled.cache_clear()
    yield csrc
    build.compiled.cache_clear()


def test_a_broken_c_file_fails_the_build(sources, monkeypatch):
    (sources / "fused_ops.c").write_text((sources / "fused_ops.c").read_text() + "\nint broken(void) { return }\n")
    with pytest.raises(build.KernelBuildError, match="fused_ops.c"):
        build.compiled("generic")
    monkeypatch.setenv("KVSNAP_KERNELS_STRICT", "0")  # a service: the error is logged, nothing loads
    build.compiled.cache_clear()
    assert build.compiled("generic") is None


def test_a_warning_is_an_error(sources):
    (sources / "block_copy.c").write_text((sources / "block_copy.c").read_text() + "\nvoid unused(void) { int x; }\n")
    with pytest.raises(build.KernelBuildError, match="unused variable"):
        build.compiled("generic")


def test_no_python_file_holds_c_source():
    marker = "#include" + " <"  # not written whole: this file would hold it
    packages = [p for p in ROOT.iterdir() if (p / "__init__.py").exists()]
    for path in (f for package in packages for f in package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert marker not in node.value, f"{path} holds C source: put it in cpu_kernels/csrc"
