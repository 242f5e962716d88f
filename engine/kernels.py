"""A decode step's one-token attention in one pass over bf16 keys and values (CPU).

``engine/batch.py``'s :func:`~.batch.one_token_attention` converts each row's bf16 keys and
values to float32 and then multiplies: the copies and the second read are half of a decode
step with 8 sessions on 2K-row caches (docs/BENCHMARKS.md, "The decode step"). The C function
here reads each key and value row once, widens it in registers and accumulates in float32, as
that function (and SDPA) do, so its output is theirs up to float32 rounding order. One call
runs every one-token row of a layer; each row is computed on its own, so a row's result never
depends on which rows share the step.

The source is compiled on first use with the machine's C compiler (``cc``) into a cache folder
keyed by the source and flags, and loaded with ctypes: no torch headers, no build step at
install. Without a compiler (or with ``KVSNAP_ATTENTION_KERNEL=0``) :func:`kernel` is None and
the torch path runs, as before. Single-threaded: a second OpenMP runtime beside torch's would
oversubscribe the cores (docs/BENCHMARKS.md, "OpenMP teams").
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

MAX_DIM = 256  # head dims up to this (SmolLM2 64, Gemma 3 256)

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

static inline float widen(uint16_t x) { uint32_t u = ((uint32_t)x) << 16; float f; memcpy(&f, &u, 4); return f; }

/* Row r: query q + r*H*D (float32, [H, D]); keys / values [Hkv, L[r], D] bf16 with head
   strides khs[r] / vhs[r] and rows of D contiguous values; out + r*H*D (float32). Query head
   h*G + g reads KV head h (grouped-query attention). scratch: G * max(L) floats. */
void one_token_rows(int R, const float *q, const uint16_t **k, const uint16_t **v, const long *L,
                    const long *khs, const long *vhs, int H, int Hkv, int D, float scale,
                    float *out, float *scratch) {
    int G = H / Hkv;
    float kf[256];
    for (int r = 0; r < R; r++) {
        long n = L[r];
        for (int h = 0; h < Hkv; h++) {
            const uint16_t *K = k[r] + h * khs[r], *V = v[r] + h * vhs[r];
            const float *qh = q + ((long)r * H + h * G) * D;
            for (long l = 0; l < n; l++) {
                const uint16_t *kr = K + l * D;
                for (int d = 0; d < D; d++) kf[d] = widen(kr[d]);
                for (int g = 0; g < G; g++) {
                    const float *qg = qh + g * D;
                    float acc = 0.f;
                    #pragma omp simd reduction(+:acc)
                    for (int d = 0; d < D; d++) acc += qg[d] * kf[d];
                    scratch[g * n + l] = acc * scale;
                }
            }
            for (int g = 0; g < G; g++) {
                float *s = scratch + g * n, m = -3.4e38f, sum = 0.f;
                for (long l = 0; l < n; l++) m = s[l] > m ? s[l] : m;
                for (long l = 0; l < n; l++) { s[l] = expf(s[l] - m); sum += s[l]; }
                float *o = out + ((long)r * H + h * G + g) * D, inv = 1.f / sum;
                for (int d = 0; d < D; d++) o[d] = 0.f;
                for (long l = 0; l < n; l++) {
                    const uint16_t *vr = V + l * D;
                    float w = s[l] * inv;
                    #pragma omp simd
                    for (int d = 0; d < D; d++) o[d] += w * widen(vr[d]);
                }
            }
        }
    }
}
"""
# -ffast-math lets the reductions and expf vectorize; the rows carry no mask, so no infinities.
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-shared", "-fPIC"]


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvsnap" / "kernels"


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")


def _build() -> ctypes.CDLL | None:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler: one-token attention runs on torch's operators")
        return None
    # -march=native: the library is this CPU's, so its flags are in the name (a shared home folder)
    digest = hashlib.sha256((SOURCE + " ".join(FLAGS) + compiler + _cpu_flags()).encode()).hexdigest()[:16]
    target = _cache_dir() / f"one_token_{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src, lib = Path(tmp) / "k.c", Path(tmp) / "k.so"
            src.write_text(SOURCE)
            done = subprocess.run([compiler, *FLAGS, str(src), "-o", str(lib), "-lm"], capture_output=True, text=True)
            if done.returncode != 0:
                log.warning("the attention kernel did not compile (%s): torch's operators run", done.stderr[-500:])
                return None
            os.replace(lib, target)  # atomic: a concurrent build sees the whole file or none
    lib = ctypes.CDLL(str(target))
    fn = lib.one_token_rows
    fn.restype = None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.argtypes += [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.argtypes += [ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p]
    return lib


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The compiled kernel, or None (no compiler, a failed build, or ``KVSNAP_ATTENTION_KERNEL=0``)."""
    if os.environ.get("KVSNAP_ATTENTION_KERNEL", "1") == "0":
        return None
    try:
        return _build()
    except OSError as exc:  # an unwritable cache folder, a library that does not load
        log.warning("the attention kernel is not available (%s): torch's operators run", exc)
        return None


def fits(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether the kernel takes this row: bf16 on a CPU, head dim <= MAX_DIM, rows contiguous."""
    dim = query.shape[-1]
    return (
        query.device.type == "cpu"
        and query.dtype == keys.dtype == values.dtype == torch.bfloat16
        and dim <= MAX_DIM
        and all(t.shape[0] == 1 and t.stride(-1) == 1 and t.stride(-2) == dim for t in (keys, values))
    )


def one_token_rows(queries: list[torch.Tensor], keys: list[torch.Tensor], values: list[torch.Tensor], scale: float):
    """Attention of one token per row over all its rows (no mask): queries ``[1, H, 1, D]``,
    keys / values ``[1, H_kv, L, D]`` (each :func:`fits`) -> per row ``[1, 1, H, D]`` bf16."""
    lib = kernel()
    heads, dim = queries[0].shape[1], queries[0].shape[-1]
    kv_heads, n = keys[0].shape[1], len(queries)
    q = torch.cat([x.reshape(heads, dim) for x in queries]).float().contiguous()  # [R * H, D]
    out = torch.empty(n * heads, dim)
    scratch = torch.empty((heads // kv_heads) * max(k.shape[-2] for k in keys))
    ptrs = ctypes.c_void_p * n
    longs = ctypes.c_long * n
    lib.one_token_rows(
        n,
        q.data_ptr(),
        ptrs(*(k.data_ptr() for k in keys)),
        ptrs(*(v.data_ptr() for v in values)),
        longs(*(k.shape[-2] for k in keys)),
        longs(*(k.stride(1) for k in keys)),
        longs(*(v.stride(1) for v in values)),
        heads,
        kv_heads,
        dim,
        scale,
        out.data_ptr(),
        scratch.data_ptr(),
    )
    return list(out.to(torch.bfloat16).view(n, 1, 1, heads, dim).unbind(0))
