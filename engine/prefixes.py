"""Shared prompt prefixes: the KV rows of a prompt's first chunks, computed once per replica and
started from by every new session of the same tenant whose prompt opens with the same tokens
(vLLM's prefix caching, for sessions that each compress their own cache afterwards).

How many tokens a block holds depends on how exact the model's arithmetic is (:func:`block_for`).
In float32 a block is one prefill chunk (``Engine.prefill_chunk`` tokens): a prefill always
runs its prompt in chunks from the prompt's start, so the rows of a prompt's first k chunks
are the same whichever session computed them, and a session that starts from them and
prefills the rest (from a chunk boundary) runs the very forward passes it would have run
alone: its cache, its compression and its answer are those of a session that prefilled
everything, bit for bit, and a replay of its log (which prefills from the start) rebuilds it
exactly. In bfloat16 on a CPU no such guarantee exists to keep: oneDNN picks its kernels by
the number of rows in a product, so a row's result already depends, in its last bits, on the
rows that share its step (docs/BENCHMARKS.md, "Blocks of 16 tokens"); there a block is
:data:`FINE_BLOCK` tokens, and a later session starts from all but the last few tokens of a
shared document (16, vLLM's block), its cache equal to one that prefilled alone within
the dtype's rounding.

Blocks form a tree per tenant: a block's key digests the tenant, its parent's key and its
tokens, so a lookup walks from a prompt's first block, and one tenant's text never reaches
another tenant's rows (nor their timing: a miss is a miss). A block holds its rows of every
layer (a sliding-window layer's too, so that a prefix of any number of blocks can start a
session), and the queries of those of its tokens its prefill had in its observation window (a
chunk's last ``window`` tokens), which a later session whose window reaches back into the
prefix takes instead of prefilling those tokens again (:func:`window_queries`). Blocks are
immutable: a session starts from their rows (engine/prefix_rows.py: referred to where the
kernels read them, else copied into its own cache) and its own question then selects its own. A
budget in bytes, least recently used first; a block is touched after its descendants, so the
least recently used block is always a leaf.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

COUNTERS = ("hits", "misses", "tokens_reused", "bytes_reused", "blocks_added", "evictions")
FINE_BLOCK = 16  # tokens a block holds where the arithmetic is not bit-exact anyway (bfloat16)


def block_for(chunk: int, dtype: torch.dtype) -> int:
    """The block a prefix cache keeps for a model computing in ``dtype`` with prefill chunks of
    ``chunk`` tokens: the chunk in float32 (sessions started from shared rows stay bit-exact),
    :data:`FINE_BLOCK` otherwise where it divides the chunk."""
    return chunk if dtype == torch.float32 or chunk % FINE_BLOCK else FINE_BLOCK


@dataclass(slots=True, eq=False)
class Block:
    """One block of a shared prefix: its rows of every layer. ``data``: per layer ``(keys,
    values)``, each ``[1, H_kv, block, D]``; or one tensor ``[2 * layers, 1, H_kv, block, D]``
    holding them in that order (one allocation: cpu_kernels/block_copy.py), read as :attr:`rows`."""

    key: bytes
    parent: bytes | None
    scope: str
    data: list[tuple[torch.Tensor, torch.Tensor]] | torch.Tensor
    children: int = 0
    route: str | None = None  # for the block that ends on the first ``route_tokens``: root_key's name
    # per full-attention layer, the queries ``[1, H, n, D]`` of the block's last n tokens, where the
    # prefill that made it had them in its observation window (see :func:`window_queries`)
    queries: dict[int, torch.Tensor] | None = None
    nbytes: int = field(init=False, default=0)  # of ``data`` and ``queries``
    addresses: bytes = field(init=False, default=b"")  # int64s in ``rows``' order (engine/prefix_rows.py)
    _rows: list[tuple[torch.Tensor, torch.Tensor]] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if isinstance(self.data, torch.Tensor):  # parts a stride apart in one allocation
            size, step = self.data.element_size(), self.data.stride(0) * self.data.element_size()
            self.nbytes = self.data.numel() * size
            base = self.data.data_ptr()
            self.addresses = array("q", range(base, base + len(self.data) * step, step)).tobytes()
        else:
            self.nbytes = sum(t.numel() * t.element_size() for kv in self.data for t in kv)
            self.addresses = array("q", [t.data_ptr() for kv in self.data for t in kv]).tobytes()
        self.nbytes += sum(q.numel() * q.element_size() for q in (self.queries or {}).values())

    @property
    def queried(self) -> int:
        """How many of its last tokens' queries it holds."""
        return next(iter(self.queries.values())).shape[-2] if self.queries else 0

    @property
    def rows(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer ``(keys, values)``, ``[1, H_kv, block, D]`` (views of :attr:`data`)."""
        if self._rows is None:
            if isinstance(self.data, torch.Tensor):
                parts = self.data.unbind(0)
                self._rows = list(zip(parts[0::2], parts[1::2], strict=True))
            else:
                self._rows = self.data
        return self._rows


def covers(blocks: list[Block], block: int, start: int) -> bool:
    """Whether ``blocks`` (a prefix, ``block`` tokens each) hold the queries of their tokens from
    ``start`` on (trivially, when they end at or before it)."""
    for j in range(len(blocks) - 1, -1, -1):
        first = j * block
        if (j + 1) * block <= start:
            return True
        if blocks[j].queried < block - max(start - first, 0):
            return False
    return True


def window_queries(blocks: list[Block], block: int, start: int) -> dict[int, torch.Tensor]:
    """Per layer, the queries ``[1, H, n, D]`` of the prefix's tokens from ``start`` to its end
    (``blocks`` :func:`covers` them): the part of a prompt's observation window that a session
    starting from these blocks does not prefill. SnapKV scores a prompt's rows by its window's
    queries; a token's query depends only on the tokens up to it, so the prefill that made the
    blocks computed these very queries (within bf16's rounding, as the rows themselves)."""
    parts = []
    for j, b in enumerate(blocks):
        if (j + 1) * block > start:
            parts.append((b.queries, block - max(start - j * block, 0)))
    if not parts:
        return {}
    return {layer: torch.cat([q[layer][:, :, -n:] for q, n in parts], dim=-2) for layer in parts[0][0]}


def _own_queries(queries: tuple[int, dict[int, torch.Tensor]] | None, index: int, block: int):
    """Copies of the queries of block ``index``'s last tokens in ``queries`` (:meth:`PrefixCache.add_chain`)."""
    if not queries or not queries[1]:
        return None
    first, by_layer = queries
    start = max(index * block, first)
    if start >= (index + 1) * block:
        return None
    return {layer: q[:, :, start - first : (index + 1) * block - first].clone() for layer, q in by_layer.items()}


def block_key(scope: str, parent: bytes | None, tokens: list[int]) -> bytes:
    """The digest naming a block: its tenant, its parent block and its tokens."""
    h = hashlib.blake2b(digest_size=16)
    name = scope.encode()
    h.update(len(name).to_bytes(4, "little") + name)
    h.update(parent or b"\0" * 16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def root_key(scope: str, tokens: list[int], route: int) -> str | None:
    """The hex name of a prompt's first ``route`` tokens (None when the prompt is not longer):
    what the router matches replicas' roots (:meth:`PrefixCache.roots`) with."""
    return block_key(scope, None, tokens[:route]).hex() if len(tokens) > route else None


class PrefixCache:
    """Blocks of ``block`` tokens under a budget of ``budget_bytes``; thread-safe.
    ``route_tokens`` (a multiple of ``block``; default one block): the prompt opening the router
    matches a replica by (:func:`root_key`, computed where the block size is not known)."""

    def __init__(self, block: int, budget_bytes: int, route_tokens: int | None = None):
        route_tokens = block if route_tokens is None else route_tokens
        if block < 1 or budget_bytes < 0 or route_tokens < block or route_tokens % block:
            raise ValueError("a prefix cache needs block >= 1, budget_bytes >= 0 and route_tokens a multiple of block")
        self.block, self.budget, self.route_tokens = block, budget_bytes, route_tokens
        self._blocks: OrderedDict[bytes, Block] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self.nbytes = 0
        self.bytes_by_scope: Counter[str] = Counter()
        self.counters: Counter[str] = Counter()  # COUNTERS
        self._memo: tuple[str | None, list[int], list[bytes]] = (None, [], [])  # the chain add made last (_keys)

    def __len__(self) -> int:
        return len(self._blocks)

    def _keys(self, scope: str, tokens: list[int], blocks: int) -> Iterator[bytes]:
        """The keys of the first ``blocks`` blocks of ``tokens``, made as they are read; those of
        the chain :meth:`add` made last are taken as they are where ``tokens`` opens with the
        same blocks (a prefill adds its blocks one by one: each would hash its whole chain)."""
        memo_scope, memo_tokens, memo_keys = self._memo
        reuse = min(blocks, len(memo_keys)) if memo_scope == scope else 0
        if reuse and tokens[: reuse * self.block] != memo_tokens[: reuse * self.block]:
            reuse = 0
        yield from memo_keys[:reuse]
        parent = memo_keys[reuse - 1] if reuse else None
        for j in range(reuse, blocks):
            parent = block_key(scope, parent, tokens[j * self.block : (j + 1) * self.block])
            yield parent

    def lookup(self, scope: str, tokens: list[int], limit: int, window_from: int | None = None) -> list[Block]:
        """The blocks of the longest known prefix of ``tokens`` no longer than ``limit`` tokens
        (counted as a hit or a miss). ``window_from``: where the prompt's observation window
        starts; a prefix reaching past it must hold its tokens' queries from there on
        (:func:`window_queries`)."""
        found: list[Block] = []
        with self._lock:
            for key in self._keys(scope, tokens, max(limit, 0) // self.block):
                block = self._blocks.get(key)
                if block is None:
                    break
                found.append(block)
            while window_from is not None and found and not covers(found, self.block, window_from):
                found.pop()
            self._touch(found)
            self.counters["hits" if found else "misses"] += 1
            self.counters["tokens_reused"] += len(found) * self.block
            self.counters["bytes_reused"] += sum(b.nbytes for b in found)
        return found

    def known(self, scope: str, tokens: list[int]) -> int:
        """How many of ``tokens``' first tokens the held blocks cover (no hit or miss counted,
        nothing touched): what a registered document has here now."""
        n = 0
        with self._lock:
            for key in self._keys(scope, tokens, len(tokens) // self.block):
                if key not in self._blocks:
                    break
                n += self.block
        return n

    def add(self, scope: str, tokens: list[int], rows: list[tuple[torch.Tensor, torch.Tensor]] | torch.Tensor) -> bool:
        """Hold ``rows`` (every layer's, of the last block of ``tokens``, whose length is a whole
        number of blocks; the caller's own copies; as :attr:`Block.data`) as that block. False
        when it is known already, its parent is not (evicted meanwhile), or it does not fit."""
        return self.add_chain(scope, tokens, [rows]) == 1

    def add_chain(
        self, scope: str, tokens: list[int], blocks: list, queries: tuple[int, dict[int, torch.Tensor]] | None = None
    ) -> int:
        """Hold the last ``len(blocks)`` blocks of ``tokens`` (each as :meth:`add`'s ``rows``),
        as a prefill's chunk makes them: those known already are skipped, and the chain stops at
        a block whose parent is not held or that does not fit the budget. The path is touched
        and the budget kept once, after all. How many of them were added and are held.
        ``queries``: ``(first, per layer [1, H, w, D])``, the queries of tokens ``first`` ..
        ``first + w - 1`` (a prefill's observation window so far, ending at or past the chain's
        end): each new block keeps copies of those of its own tokens."""
        n = len(tokens) // self.block
        if n < max(1, len(blocks)) or len(tokens) % self.block:
            raise ValueError(f"a prefix block ends on a multiple of {self.block} tokens, not {len(tokens)}")
        keys = list(self._keys(scope, tokens, n))
        self._memo = (scope, tokens[: n * self.block], keys)
        added: list[Block] = []
        with self._lock:
            for i, data in enumerate(blocks, start=n - len(blocks)):
                parent_key = keys[i - 1] if i else None
                parent = self._blocks.get(parent_key) if i else None
                if keys[i] in self._blocks:
                    continue
                block = Block(keys[i], parent_key, scope, data, queries=_own_queries(queries, i, self.block))
                if (i and parent is None) or block.nbytes > self.budget:
                    break
                if (i + 1) * self.block == self.route_tokens:
                    block.route = block_key(scope, None, tokens[: self.route_tokens]).hex()
                self._blocks[block.key] = block
                if parent is not None:
                    parent.children += 1
                self.nbytes += block.nbytes
                self.bytes_by_scope[scope] += block.nbytes
                self.counters["blocks_added"] += 1
                added.append(block)
            if not added:
                return 0
            self._touch(self._path(added[-1]))
            self._evict()
            return sum(block.key in self._blocks for block in added)

    def _path(self, block: Block) -> list[Block]:
        """``block`` and its ancestors, root first."""
        path = [block]
        while path[-1].parent is not None:
            path.append(self._blocks[path[-1].parent])
        return path[::-1]

    def _touch(self, path: list[Block]) -> None:
        """Mark a root-first path used: deepest first, so every block is newer than its descendants."""
        for block in reversed(path):
            self._blocks.move_to_end(block.key)

    def _evict(self) -> None:
        while self.nbytes > self.budget:
            leaf = next(b for b in self._blocks.values() if b.children == 0)  # the first one, by the order
            del self._blocks[leaf.key]
            if leaf.parent is not None:
                self._blocks[leaf.parent].children -= 1
            self.nbytes -= leaf.nbytes
            self.bytes_by_scope[leaf.scope] -= leaf.nbytes
            if not self.bytes_by_scope[leaf.scope]:
                del self.bytes_by_scope[leaf.scope]
            self.counters["evictions"] += 1

    def roots(self, limit: int = 256) -> list[str]:
        """The :func:`root_key` names of the prompt openings (``route_tokens`` long) held, most
        recently used first (at most ``limit``): what a replica tells the router, so that a new
        session on a known document goes here. A held block's ancestors are held too."""
        with self._lock:
            found = [b.route for b in reversed(self._blocks.values()) if b.route is not None]
        return found[:limit]

    def stats(self) -> dict:
        """What ``/metrics`` shows: bytes held (in all and per tenant), blocks, and the counters."""
        with self._lock:
            return {
                "bytes": self.nbytes,
                "blocks": len(self._blocks),
                "bytes_by_tenant": dict(self.bytes_by_scope),
                **{k: self.counters[k] for k in COUNTERS},
            }
