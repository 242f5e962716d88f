"""One decode step for many sessions at once, each on its own cache.

Everything but attention (embeddings, projections, MLPs, norms, the LM head) runs as one
batched forward over the sessions' next tokens ``[B, 1]``; that is where a decode step's
time goes, and batching reads the weights once for all B rows. Attention runs per row on
that row's own cache layers (:class:`BatchCache` hands the attention function a
:class:`RaggedKV`, one ``[1, H_kv, rows_b, D]`` view per session), so no cache is padded,
stacked or copied per step, and a row can only ever attend to its own session's rows.

Each row has its own RoPE position (its session's ``logical_len``), its own kept rows and its
own sliding window: with one query per row, every row a layer returns is visible to it (a
full layer returns its kept rows, a sliding layer its last ``window - 1`` rows), so no mask
is built at all.
"""

from __future__ import annotations

import torch

from .session import Session

# A 4-D mask makes transformers' mask builders return it as it is (they build none); the
# ragged attention ignores it.
_NO_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)


class RaggedKV(list):
    """One layer's keys (or values) for a batch: one ``[1, H_kv, rows_b, D]`` view per row."""

    __slots__ = ()


class BatchCache:
    """The cache object a batched decode forward sees: row ``b``'s keys and values go to
    session ``b``'s own cache layer, and attention gets each row's layer back."""

    is_compileable = False

    def __init__(self, caches: list):
        self.caches = caches
        self.layers = caches[0].layers  # layer kinds, for code that inspects them (all sessions share them)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = RaggedKV(), RaggedKV()
        for b, cache in enumerate(self.caches):  # key_states: [B, H_kv, 1, D]
            k, v = cache.layers[layer_idx].update(key_states[b : b + 1], value_states[b : b + 1])
            keys.append(k)
            values.append(v)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise NotImplementedError("a batch has one length per row: pass position_ids")


def ragged_attention(attend, module, query: torch.Tensor, keys: RaggedKV, values: RaggedKV, **kwargs):
    """``attend`` (an attention function) row by row; query ``[B, H, 1, D]`` -> ``[B, 1, H, D]``."""
    outputs = [attend(module, query[b : b + 1], keys[b], values[b], None, **kwargs)[0] for b in range(len(keys))]
    return torch.cat(outputs, dim=0), None


def batch_inputs(sessions: list[Session], device) -> dict:
    """The forward's inputs for one decode step: each session's pending token at its own position."""
    for s in sessions:
        if len(s.pending) != 1:
            raise ValueError(f"session {s.session_id} has {len(s.pending)} pending tokens; a decode step feeds one")
    ids = torch.tensor([s.pending for s in sessions], dtype=torch.long, device=device)  # [B, 1]
    positions = torch.tensor([[s.logical_len] for s in sessions], dtype=torch.long, device=device)  # [B, 1]
    return {
        "input_ids": ids,
        "position_ids": positions,
        "cache": BatchCache([s.cache for s in sessions]),
        "attention_mask": _NO_MASK.to(device),
        "use_cache": True,
    }
