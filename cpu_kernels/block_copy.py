"""Copies between a session's layer buffers and shared prefix blocks, in C (CPU, 2-byte rows).

A shared prefix (engine/prefixes.py) is held in blocks of 16 tokens where the model computes
in bf16, each with the rows of every layer: a 2.4K-token document on a 30-layer model is 150
blocks of 60 parts. Made with torch, that is one slice and one copy per part (9,000 small
operators, ~80 ms of a first chat's prefill); read back, one concatenation per layer. Here
each direction is one call over all blocks and parts, the parts spread over torch's own
OpenMP threads (cpu_kernels/build.py):

- :func:`scatter_blocks`: the rows a prompt chunk just appended to every layer into new
  blocks, one allocation per block (``[parts, 1, H_kv, block, D]``; a block's parts are views
  of it), so a block evicted on its own frees its own memory.
- :func:`gather_blocks`: consecutive blocks into a new session's buffers, which keep room for
  the turn's own rows after them (engine/prefix_rows.py ``fill_prefix``).
- :func:`gather_rows`: the rows a compression keeps of a session whose first rows are still a
  shared prefix's (engine/prefix_rows.py): from the blocks and the session's buffer at once.

All are plain copies: the rows are bit-equal to torch's (tests/cpu_kernels/test_block_copy.py). C source:
cpu_kernels/csrc/block_copy.c, in every variant; where none runs (:func:`available` False) torch copies.
"""

from __future__ import annotations

import ctypes

import torch

from . import build

_LONG, _PTR = ctypes.c_long, ctypes.c_void_p
_SIGNATURES = {
    "gather_blocks": [_LONG] * 5 + [_PTR] * 4 + [ctypes.c_int],
    "scatter_blocks": [_LONG] * 5 + [_PTR] * 3 + [ctypes.c_int],
    "gather_rows": [_LONG] * 3 + [_PTR, _LONG, _LONG, _PTR, _LONG, _PTR, _PTR, ctypes.c_int],
}


def _fn(name: str):
    return build.function(name, None, _SIGNATURES[name])


def available() -> bool:
    return _fn("gather_rows") is not None


def takes(parts: list[torch.Tensor]) -> bool:
    """Whether the C copy takes these parts (``[1, H_kv, rows, D]`` each): 2-byte values of one
    shape in host memory, rows of ``D`` contiguous values, and a compiled library."""
    first = parts[0]
    dim = first.shape[-1]
    return (
        first.device.type == "cpu"
        and first.element_size() == 2
        and all(t.shape == first.shape and t.dtype == first.dtype and t.stride()[2:] == (dim, 1) for t in parts)
        and available()
    )


def gather_blocks(addresses: bytes, blocks: int, rows: int, buffers: list[torch.Tensor], first: list[int]) -> None:
    """Copy ``blocks`` consecutive blocks of ``rows`` rows into ``buffers`` (per part, a layer's
    keys or values: ``[1, H_kv, capacity, D]`` of 2-byte values, same H_kv and D for all), part
    p from block ``first[p]`` on. ``addresses``: per block, its parts' addresses (int64 each,
    parts in the buffers' order), each ``[1, H_kv, rows, D]`` contiguous."""
    parts = len(buffers)
    _, heads, _, dim = buffers[0].shape
    longs = ctypes.c_long * parts
    _fn("gather_blocks")(
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
    _fn("scatter_blocks")(
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
    _fn("gather_rows")(
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
