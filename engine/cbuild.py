"""Small C libraries of the engine's own kernels, compiled on first use and loaded with ctypes.

A kernel module (``engine/kernels.py``: decode attention) keeps its C source as a string.
:func:`build` compiles it with the machine's C compiler (``cc``, or ``CC``) for this CPU
(``-march=native``) into a cache folder keyed by the source, the flags, the compiler and the
CPU's flags, and loads it: no torch headers, no build step at install. With OpenMP the library
links ``libgomp.so.1``, which resolves to the copy torch has loaded, so a kernel's ``#pragma
omp parallel`` runs on the calling thread's own team (the model thread's: engine/threads.py),
no second thread pool; a compiler without OpenMP builds it single-threaded. Without a
compiler, on a failed build, or with ``KVSNAP_C_KERNELS=0``, :func:`build` gives None and the
engine runs torch's operators instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

# -ffast-math lets reductions and expf / tanhf vectorize (libmvec): results equal the torch
# operators' up to float32 rounding order (each kernel's docstring says which roundings it keeps).
# It is for compiling only: linked with it, gcc before 13 adds a start-up file that turns on
# flush-to-zero for the whole process when the library loads (float32 denormals would become 0
# in every torch operator), so the link is a second command without it.
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fPIC"]
PARALLEL = ("-fopenmp", "-fopenmp-simd")  # the first that builds


def enabled() -> bool:
    return os.environ.get("KVSNAP_C_KERNELS", "1") != "0"


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvsnap" / "kernels"


def _cpuinfo(starts: tuple[str, ...]) -> str | None:
    """The first line of /proc/cpuinfo that starts with one of ``starts`` ("" if none), or None
    where there is no such file."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return next((line for line in text.splitlines() if line.startswith(starts)), "")


def cpu_flags() -> str:
    line = _cpuinfo(("flags", "Features"))
    return platform.processor() if line is None else line


def cpu_model() -> str:
    """The CPU's name as Linux reports it (benchmarks record where they ran), or the platform's."""
    line = _cpuinfo(("model name",))
    return (line or "").partition(":")[2].strip() or platform.processor()


def build(name: str, source: str) -> ctypes.CDLL | None:
    """The library of ``source`` (built once per machine), or None where it cannot be had."""
    if not enabled():
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler: the %s kernels run as torch's operators", name)
        return None
    # -march=native: the library is this CPU's, so its flags are in the name (a shared home folder)
    digest = hashlib.sha256((source + " ".join(FLAGS) + compiler + cpu_flags()).encode()).hexdigest()[:16]
    target = _cache_dir() / f"{name}_{digest}.so"
    try:
        if not target.exists() and not _compile(compiler, source, target, name):
            return None
        return ctypes.CDLL(str(target))
    except OSError as exc:  # an unwritable cache folder, a library that does not load
        log.warning("the %s kernels are not available (%s): torch's operators run", name, exc)
        return None


def _compile(compiler: str, source: str, target: Path, name: str) -> bool:
    """Build ``target`` with OpenMP, or single-threaded where the compiler has no OpenMP runtime."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, obj, lib = Path(tmp) / "k.c", Path(tmp) / "k.o", Path(tmp) / "k.so"
        src.write_text(source)
        for parallel in PARALLEL:
            build = [compiler, *FLAGS, parallel, "-c", str(src), "-o", str(obj)]
            done = subprocess.run(build, capture_output=True, text=True)
            if done.returncode == 0:
                link = [compiler, "-shared", parallel, str(obj), "-o", str(lib), "-lm"]
                done = subprocess.run(link, capture_output=True, text=True)
            if done.returncode == 0:
                os.replace(lib, target)  # atomic: a concurrent build sees the whole file or none
                return True
    log.warning("the %s kernels did not compile (%s): torch's operators run", name, done.stderr[-500:])
    return False
