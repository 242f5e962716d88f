"""Copies between a session's layer buffers and shared prefix blocks, in C (CPU, 2-byte rows).

A shared prefix (engine/prefixes.py) is held in blocks of 16 tokens where the model computes
in bf16, each with the rows of every layer: a 2.4K-token document on a 30-layer model is 150
blocks of 60 parts. Made with torch, that is one slice and one copy per part (9,000 small
operators, ~80 ms of a first chat's prefill); read back, one concatenation per layer. Here
each direction is one call over all blocks and parts, the parts spread over torch's own
OpenMP threads (engine/cbuild.py):

- :func:`scatter_blocks`: the rows a prompt chunk just appended to every layer into new
  blocks, one allocation per block (``[parts, 1, H_kv, block, D]``; a block's parts are views
  of it), so a block evicted on its own frees its own memory.
- :func:`gather_blocks`: consecutive blocks into a new session's buffers, which keep room for
  the turn's own rows after them (engine/prefix_rows.py ``fill_prefix``).
- :func:`gather_rows`: the rows a compression keeps of a session whose first rows are still a
  shared prefix's (engine/prefix_rows.py): from the blocks and the session's buffer at once.

All are plain copies: the rows are bit-equal to torch's (tests/test_fill_prefix.py). Without
a compiler (or with ``KVSNAP_C_KERNELS=0``) :func:`kernel` is None and torch copies.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from . import cbuild

SOURCE = r"""
#include <stdint.h>
#include <string.h>

/* Consecutive blocks of a shared prefix into a new session's buffers: part p (a layer's keys
   or values) takes blocks first[p] .. B-1, block b's part at src[b * P + p] ([Hkv, T, D]
   values, contiguous), to rows (b - first[p]) * T on of its buffer dst[p] ([Hkv, cap[p], D]). */
void gather_blocks(long B, long P, long T, long Hkv, long D, const long *src, uint16_t **dst, const long *first,
                   const long *cap, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long p = 0; p < P; p++)
        for (long b = first[p]; b < B; b++)
            for (long h = 0; h < Hkv; h++)
                memcpy(dst[p] + (h * cap[p] + (b - first[p]) * T) * D, (const uint16_t *)src[b * P + p] + h * T * D,
                       sizeof(uint16_t) * T * D);
}

/* The rows just appended to a session's layers into new blocks: part p (rows from src[p] on,
   its heads hs[p] values apart, rows of D) gives rows b * T .. (b + 1) * T - 1 to block b, whose
   parts are contiguous at dst[b] ([P, Hkv, T, D]). */
void scatter_blocks(long B, long P, long T, long Hkv, long D, const long *src, const long *hs, uint16_t **dst,
                    int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long p = 0; p < P; p++)
        for (long b = 0; b < B; b++)
            for (long h = 0; h < Hkv; h++)
                memcpy(dst[b] + (p * Hkv + h) * T * D, (const uint16_t *)src[p] + h * hs[p] + b * T * D,
                       sizeof(uint16_t) * T * D);
}

/* Rows pos[h * R + r] of a layer's keys or values whose first `shared` rows lie in blocks of bs
   rows (block b's part at blocks[b], its heads bs * D values apart) and the rest at own (heads hs
   apart), to dst ([Hkv, R, D] contiguous): a selection kept from shared and own rows at once. */
void gather_rows(long R, long Hkv, long D, const long *blocks, long shared, long bs, const uint16_t *own, long hs,
                 const long *pos, uint16_t *dst, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long h = 0; h < Hkv; h++)
        for (long r = 0; r < R; r++) {
            long p = pos[h * R + r];
            const uint16_t *src = p < shared ? (const uint16_t *)blocks[p / bs] + (h * bs + p % bs) * D
                                             : own + h * hs + (p - shared) * D;
            memcpy(dst + (h * R + r) * D, src, sizeof(uint16_t) * D);
        }
}
"""


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The compiled library, or None (engine/cbuild.py: no compiler, a failed build, or
    ``KVSNAP_C_KERNELS=0``)."""
    lib = cbuild.build("block_copy", SOURCE)
    if lib is not None:
        lib.gather_blocks.restype = lib.scatter_blocks.restype = None
        lib.gather_blocks.argtypes = [ctypes.c_long] * 5 + [ctypes.c_void_p] * 4 + [ctypes.c_int]
        lib.scatter_blocks.argtypes = [ctypes.c_long] * 5 + [ctypes.c_void_p] * 3 + [ctypes.c_int]
        lib.gather_rows.restype = None
        lib.gather_rows.argtypes = [ctypes.c_long] * 3 + [ctypes.c_void_p, ctypes.c_long, ctypes.c_long]
        lib.gather_rows.argtypes += [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    return lib


def takes(parts: list[torch.Tensor]) -> bool:
    """Whether the C copy takes these parts (``[1, H_kv, rows, D]`` each): 2-byte values of one
    shape in host memory, rows of ``D`` contiguous values, and a compiled library."""
    first = parts[0]
    dim = first.shape[-1]
    return (
        first.device.type == "cpu"
        and first.element_size() == 2
        and all(t.shape == first.shape and t.dtype == first.dtype and t.stride()[2:] == (dim, 1) for t in parts)
        and kernel() is not None
    )


def gather_blocks(addresses: bytes, blocks: int, rows: int, buffers: list[torch.Tensor], first: list[int]) -> None:
    """Copy ``blocks`` consecutive blocks of ``rows`` rows into ``buffers`` (per part, a layer's
    keys or values: ``[1, H_kv, capacity, D]`` of 2-byte values, same H_kv and D for all), part
    p from block ``first[p]`` on. ``addresses``: per block, its parts' addresses (int64 each,
    parts in the buffers' order), each ``[1, H_kv, rows, D]`` contiguous."""
    parts = len(buffers)
    _, heads, _, dim = buffers[0].shape
    longs = ctypes.c_long * parts
    kernel().gather_blocks(
        blocks,
        parts,
        rows,
        heads,
        dim,
        (ctypes.c_long * (blocks * parts)).from_buffer_copy(addresses),
        (ctypes.c_void_p * parts)(*(t.data_ptr() for t in buffers)),
        longs(*first),
        longs(*(t.shape[-2] for t in buffers)),
        torch.get_num_threads(),  # the calling thread's team, parts split over it
    )


def scatter_blocks(parts: list[torch.Tensor], block: int) -> list[torch.Tensor]:
    """``parts`` (per layer its keys then its values, ``[1, H_kv, n, D]`` each, :func:`takes`)
    cut into ``n / block`` new blocks: per block one tensor ``[len(parts), 1, H_kv, block, D]``."""
    _, heads, n, dim = parts[0].shape
    count = n // block
    blocks = [parts[0].new_empty((len(parts), 1, heads, block, dim)) for _ in range(count)]
    longs = ctypes.c_long * len(parts)
    kernel().scatter_blocks(
        count,
        len(parts),
        block,
        heads,
        dim,
        longs(*(t.data_ptr() for t in parts)),
        longs(*(t.stride(1) for t in parts)),
        (ctypes.c_void_p * count)(*(b.data_ptr() for b in blocks)),
        torch.get_num_threads(),
    )
    return blocks


def gather_rows(addresses: torch.Tensor, shared: int, block: int, own: torch.Tensor, positions: torch.Tensor):
    """Rows ``positions`` (``[1, H_kv, k]`` int64, contiguous) of a layer's keys or values whose first
    ``shared`` rows lie in blocks of ``block`` rows (``addresses``: int64 ``[blocks]``, each block's
    part ``[1, H_kv, block, D]`` contiguous) and the rest in ``own`` (``[1, H_kv, n, D]``, rows of D
    contiguous) -> a new ``[1, H_kv, k, D]`` tensor."""
    _, heads, count = positions.shape
    dim = own.shape[-1]
    out = own.new_empty((1, heads, count, dim))
    kernel().gather_rows(
        count,
        heads,
        dim,
        addresses.data_ptr(),
        shared,
        block,
        own.data_ptr(),
        own.stride(1),
        positions.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out
