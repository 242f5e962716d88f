"""The engine's own compute kernels: C sources under ``csrc/``, one shared library per ISA
variant (cpu_kernels/build.py), chosen per CPU at load, loaded with ctypes; torch's operators where
none runs. Imports only torch: the engine and the policies call it, never the other way round.

The kernels, named by what they compute (each module: ``available()``, ``takes(...)`` for the
shapes it takes, and the computation):

- :mod:`.decode_attention`: a decode step's one-token attention; :mod:`.decode_rows` appends a
  step's rows and attends them in one call a layer;
- :mod:`.chunk_attention`: a prompt chunk's flash attention (AMX tiles or AVX-512 BF16 vectors);
- :mod:`.snapkv_votes`: SnapKV's observation-window votes;
- :mod:`.linear_vectors`, :mod:`.linear_tiles`: a decode step's few-row linear products;
- :mod:`.fused_ops`: RMS norm, gated activation and RoPE in one pass each;
- :mod:`.block_copy`: copies between shared-prefix blocks and a session's buffers.

Bits are equal within one variant only: a session replayed or handed over to another variant
(or to torch's path) gets the same policy's rows and tokens within the dtype's tolerance.
"""

from __future__ import annotations

import logging

from . import build

log = logging.getLogger(__name__)


def available() -> bool:
    """Whether a kernel variant runs in this process (else torch's operators run everywhere)."""
    return build.library() is not None


def variant() -> str | None:
    """The variant this process runs: ``amx``, ``avx512bf16``, ``generic``, or None."""
    return build.chosen() if available() else None


def warm() -> str:
    """Build (or load from the cache) this CPU's variant now, not in a request's step, and say in
    the log which one runs; returns that line."""
    chosen = variant()
    if chosen is None:
        why = "KVSNAP_C_KERNELS=0" if not build.enabled() else "no variant built or runs here"
        line = f"kernels: none ({why}): torch's operators run"
    else:
        line = f"kernels: variant {chosen} ({build.cpu_model() or 'this CPU'})"
    log.info(line)
    return line
