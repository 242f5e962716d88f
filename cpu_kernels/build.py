"""The kernels' build: every C file under ``cpu_kernels/csrc`` compiled into one shared library per
ISA variant, one variant chosen per CPU at load, loaded with ctypes.

Variants, best first (:data:`VARIANTS`):

- ``amx``: Sapphire Rapids and later: AMX tiles for a prompt chunk's products (and a step's
  linear products), AVX-512 BF16 for the rest;
- ``avx512bf16``: AVX-512 with BF16 dot products (x86-64-v4 + ``avx512_bf16``: AMD Zen 4 and
  later, Cooper Lake): the vector builds of every kernel;
- ``generic``: any CPU the compiler targets: the kernels written in plain C (decode attention,
  fused ops, block copies); the rest run as torch's operators.

Flags are explicit per variant (no ``-march=native``), so one machine builds every variant: an
x86 CI compiles all three, and runs those its CPU can. Each is compiled with ``-Wall -Wextra``
(and ``-Werror`` with ``KVSNAP_KERNELS_STRICT=1``: the tests and ``make lint``; a service logs
a warning and goes on) into a cache folder keyed by the sources, the flags and the compiler
(``KVSNAP_KERNEL_DIR`` or ``~/.cache/kvsnap/kernels``); ``python -m kvsnap.cpu_kernels`` builds them ahead of time
(``make install`` and a cluster node's setup do), so a process loads them in milliseconds.

Which variant runs: ``KVSNAP_KERNEL_VARIANT`` if set, else the best this CPU runs (and, for
``amx``, Linux grants the tiles' state); ``KVSNAP_C_KERNELS=0``: none (torch's operators run
everywhere). Without a C compiler, libraries built ahead of time still load; with none, torch's
operators run, said once in the log. A variant that does not
compile is an error in the log and the next variant runs; with ``KVSNAP_KERNELS_STRICT=1`` (the
tests) it raises :class:`KernelBuildError`. Bits are equal within one variant only: another
variant (or torch's path) computes the same rows within the dtype's tolerance.

With OpenMP the library links ``libgomp.so.1``, which resolves to the copy torch has loaded, so a
kernel's ``#pragma omp parallel`` runs on the calling thread's own team (engine/threads.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
X86 = platform.machine().lower() in ("x86_64", "amd64")
# variant -> (compiler flags, the CPU flags it needs); generic targets the machine's base ISA
VARIANTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "amx": (
        ("-march=sapphirerapids", "-mprefer-vector-width=512"),
        ("amx_tile", "amx_bf16", "avx512_bf16", "avx512bw", "avx512vl"),
    ),
    "avx512bf16": (
        ("-march=x86-64-v4", "-mavx512bf16", "-mprefer-vector-width=512"),
        ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_bf16"),
    ),
    "generic": (("-march=x86-64",) if X86 else (), ()),
}
# -ffast-math lets reductions and expf / tanhf vectorize: results equal torch's operators up to
# float32 rounding order (each kernel's docstring says which roundings it keeps). It is for
# compiling only: linked with it, gcc before 13 adds a start-up file that turns on flush-to-zero
# for the whole process (float32 denormals would become 0 in every torch operator).
FLAGS = ("-O3", "-ffast-math", "-fPIC", "-Wall", "-Wextra", "-Wno-unused-parameter", "-std=gnu11")
STRICT_FLAGS = ("-Werror",)  # tests and lint (KVSNAP_KERNELS_STRICT=1): a warning is an error
PARALLEL = ("-fopenmp", "-fopenmp-simd")  # the first that builds: OpenMP threads, or one thread
_override: list[str | None] = []  # use(): the variant a test or benchmark asks for


class KernelBuildError(RuntimeError):
    """A variant's C sources did not compile (the compiler's message attached)."""


def enabled() -> bool:
    return os.environ.get("KVSNAP_C_KERNELS", "1") != "0"


def strict() -> bool:
    return os.environ.get("KVSNAP_KERNELS_STRICT", "0") == "1"


def buildable() -> list[str]:
    """The variants this machine's compiler targets: all three on x86, ``generic`` elsewhere."""
    return list(VARIANTS) if X86 else ["generic"]


@functools.cache
def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _cpuinfo_line(starts: tuple[str, ...]) -> str:
    return next((line for line in _cpuinfo().splitlines() if line.startswith(starts)), "")


@functools.cache
def cpu_flags() -> frozenset[str]:
    return frozenset(_cpuinfo_line(("flags", "Features")).partition(":")[2].split())


def cpu_model() -> str:
    """The CPU's name as Linux reports it (benchmarks record where they ran), or the platform's."""
    return _cpuinfo_line(("model name",)).partition(":")[2].strip() or platform.processor()


@functools.cache
def runs_here(variant: str) -> bool:
    """Whether this CPU has every instruction set ``variant`` is compiled for."""
    return variant in buildable() and set(VARIANTS[variant][1]) <= cpu_flags()


def compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def _flags(variant: str) -> list[str]:
    return [*FLAGS, *(STRICT_FLAGS if strict() else ()), *VARIANTS[variant][0]]


def _sources() -> list[Path]:
    return sorted(CSRC.glob("*.c"))


def _root() -> Path:
    return Path(os.environ.get("KVSNAP_KERNEL_DIR", Path.home() / ".cache" / "kvsnap" / "kernels"))


def _digest(parts: list[bytes]) -> str:
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:12]


def target(variant: str, cc: str) -> Path:
    """Where ``variant``'s library is cached: named by digests of the sources and flags, then of
    the compiler (a machine without one still finds a library built ahead of time)."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    return _root() / f"{_prefix(variant)}{_digest([cc.encode(), *(v.encode() for v in version)])}.so"


def _prefix(variant: str) -> str:
    sources = [p.read_bytes() for p in sorted(CSRC.glob("*.[ch]"))]
    flags = " ".join(_flags(variant))  # strict builds apart: a warning must fail them, not hit a cache
    return f"libkvsnap_{variant}_{_digest([*sources, flags.encode()])}_"


def _prebuilt(variant: str) -> Path | None:
    """A library of these sources and flags built ahead of time by any compiler, the newest."""
    found = sorted(_root().glob(f"{_prefix(variant)}*.so"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


@functools.cache
def _no_compiler() -> None:
    log.warning("no C compiler (cc or CC) and no kernels built ahead of time: torch's operators run")


@functools.cache
def compiled(variant: str) -> Path | None:
    """``variant``'s library, compiled once per machine (cached), or None: no compiler and none
    built ahead of time, or it did not compile (an error in the log; raised with :func:`strict`)."""
    cc = compiler()
    if cc is None:
        path = _prebuilt(variant)
        if path is None:
            _no_compiler()
        return path
    path = target(variant, cc)
    if path.exists():
        return path
    started = time.perf_counter()
    try:
        error = _compile(cc, variant, path)
    except OSError as exc:  # an unwritable cache folder
        error = f"{type(exc).__name__}: {exc}"
    if error is None:
        log.info("kernels: compiled variant %s in %.1f s (%s)", variant, time.perf_counter() - started, path.name)
        return path
    if strict():
        raise KernelBuildError(f"the {variant} kernels did not compile:\n{error}")
    log.error("the %s kernels did not compile; another variant or torch's operators run:\n%s", variant, error)
    return None


def _compile(cc: str, variant: str, path: Path) -> str | None:
    """Compile every source with ``variant``'s flags and link them into ``path``; the error or None."""
    path.parent.mkdir(parents=True, exist_ok=True)
    parallel = _parallel(cc)
    quiet = ["-Wno-unknown-pragmas"] if parallel != PARALLEL[0] else []  # OpenMP's pragmas, without OpenMP
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        flags = [*_flags(variant), parallel, *quiet, f"-I{CSRC}"]
        objects = [Path(tmp) / f"{src.stem}.o" for src in _sources()]
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            error = "".join(pool.map(lambda s, o: _run([cc, *flags, "-c", str(s), "-o", str(o)]), _sources(), objects))
        if not error:
            lib = Path(tmp) / "lib.so"
            error = _run([cc, "-shared", parallel, *map(str, objects), "-o", str(lib), "-lm"])
        if not error:
            os.replace(lib, path)  # atomic: a concurrent build sees the whole file or none
            return None
    return error[-4000:]


@functools.cache
def _parallel(cc: str) -> str:
    """``-fopenmp`` where the compiler links OpenMP, else ``-fopenmp-simd`` (one thread a call)."""
    with tempfile.TemporaryDirectory() as tmp:
        probe = CSRC / "probe" / "openmp.c"
        if not _run([cc, "-fopenmp", "-shared", "-fPIC", str(probe), "-o", str(Path(tmp) / "omp.so")]):
            return PARALLEL[0]
    log.warning("the C compiler has no OpenMP: each kernel call runs on one thread")
    return PARALLEL[1]


def _run(command: list[str]) -> str:
    """The command's error ("" when it succeeded; its warnings then go to the log)."""
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode == 0 and done.stderr.strip():
        log.warning("%s\n%s", " ".join(command), done.stderr.strip())
    return "" if done.returncode == 0 else f"$ {' '.join(command)}\n{done.stderr}"


def compile_all(variants: list[str] | None = None) -> dict[str, Path | None]:
    """Build every variant this compiler targets (ahead of time, and the tests)."""
    return {v: compiled(v) for v in variants or buildable()}


@functools.cache
def _load(variant: str) -> ctypes.CDLL | None:
    path = compiled(variant)
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:  # a cache on a noexec mount, a symbol this libc lacks
        if strict():
            raise KernelBuildError(f"the {variant} kernels do not load: {exc}") from exc
        log.error("the %s kernels do not load (%s): another variant or torch's operators run", variant, exc)
        return None
    if variant == "amx" and lib.kvsnap_amx_init() != 0:
        log.warning("Linux refused the AMX tile state: the amx kernels cannot run")
        return None
    return lib


def chosen() -> str | None:
    """The variant this process runs: :func:`use`'s, ``KVSNAP_KERNEL_VARIANT``, or the best this
    CPU runs that loads; None where the kernels are off or none can be had."""
    if _override:
        return _override[-1]
    return _best()


@functools.cache
def _best() -> str | None:
    if not enabled():
        return None
    named = os.environ.get("KVSNAP_KERNEL_VARIANT")
    if named:
        if named not in VARIANTS:
            raise ValueError(f"KVSNAP_KERNEL_VARIANT={named!r}: valid variants are {', '.join(VARIANTS)}")
        if runs_here(named) and _load(named) is not None:
            return named
        log.warning("KVSNAP_KERNEL_VARIANT=%s cannot run here: torch's operators run", named)
        return None
    return next((v for v in buildable() if runs_here(v) and _load(v) is not None), None)


def runnable() -> list[str]:
    """The variants this process can run (its CPU's instructions, built, loaded), best first."""
    return [v for v in buildable() if enabled() and runs_here(v) and _load(v) is not None]


def library(variant: str | None = None) -> ctypes.CDLL | None:
    """The loaded library of ``variant`` (default :func:`chosen`), or None."""
    variant = variant or chosen()
    if variant is None or not runs_here(variant) or not enabled():
        return None
    return _load(variant)


@contextlib.contextmanager
def use(variant: str | None):
    """Run the kernels of ``variant`` (None: torch's operators) within the block (tests, benchmarks)."""
    if variant is not None and not runs_here(variant):
        raise ValueError(f"this CPU cannot run the {variant} kernels")
    _override.append(variant)
    try:
        yield
    finally:
        _override.pop()


def function(name: str, restype, argtypes: list, variant: str | None = None):
    """The C function ``name`` of ``variant``'s library (default :func:`chosen`) with its ctypes
    signature, or None where that library does not exist or was compiled without it (the function
    needs other instructions). Resolved once per variant: a kernel call costs a dict lookup."""
    key = (name, variant or (_override[-1] if _override else _best()))
    found = _functions.get(key, _functions)  # the dict itself: not looked up yet
    if found is _functions:
        lib = library(key[1]) if key[1] is not None else None
        found = getattr(lib, name, None) if lib is not None else None
        if found is not None:
            found.restype, found.argtypes = restype, argtypes
        _functions[key] = found
    return found


_functions: dict[tuple[str, str], object] = {}


def run_on_team(fn, *args, what: str) -> None:
    """Call the kernel ``fn`` with ``args`` and, last, the calling thread's team size (torch's
    OpenMP threads: engine/threads.py); MemoryError naming ``what`` when it returns non-zero (it
    could not allocate its work space)."""
    import torch  # the build itself needs no torch; the kernels it loads work on torch's tensors

    if fn(*args, torch.get_num_threads()):
        raise MemoryError(f"{what} could not allocate its work space")


def main() -> int:
    """``python -m kvsnap.cpu_kernels``: build every variant now (install, a node's setup,
    ``make lint``). Fails where the variant this CPU would run does not build (with
    ``KVSNAP_KERNELS_STRICT=1``: any variant, warnings included); without a compiler it says so
    and succeeds (torch's operators run)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if compiler() is None:
        print("kernels: no C compiler (cc or CC): torch's operators will run")
        return 0
    built = compile_all()
    for variant, path in built.items():
        runs = "runs here" if runs_here(variant) else "compile only: this CPU lacks its instructions"
        print(f"kernels {variant}: {'built ' + path.name if path else 'NOT BUILT'} ({runs})")
    print(f"kernels: this machine runs {chosen() or 'none (torch operators)'}")
    needed = [v for v in built if runs_here(v)][:1] if not strict() else list(built)
    return 0 if all(built[v] for v in needed) else 1
