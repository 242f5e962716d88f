"""An independent reference for the forward pass on a SnapKV-compressed cache.

With policy ``full`` a resumed session equals one plain forward pass (tests/engine/test_engine_invariants.py).
This file checks the compressed case the same way. After a first turn has compressed the
cache, a follow-up on the session must compute exactly what ONE uncached forward pass over
the whole transcript computes when, in every full-attention layer, each follow-up token may
attend only to the prefix rows its KV head kept (plus, causally, to the follow-up tokens),
at their true positions. Sliding-window layers keep their plain sliding-window mask.

The mask differs per layer and per KV head, so the reference runs its own attention
(registered with transformers as ``kvsnap-reference``, on a deep copy of the engine's
model, so the engine's model is never touched): masked softmax(q k^T * scale) v in fp32,
with query head h reading KV head h // (H / H_kv). Nothing from the kvsnap cache or mask
code is used; the kept positions come from the policy's selection as the engine applied it
(``CompressedLayer.keep``), checked against the full-KV rows at those positions.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from kvsnap.engine import Engine, load_model
from kvsnap.engine.cache import CompressedLayer, full_layer_indices
from kvsnap.policies import make_policy

from ..conftest import random_tokens

REFERENCE = "kvsnap-reference"
PROMPT, FOLLOW_UP = 40, 6
BUDGET, WINDOW = 8, 4  # 40 prompt rows -> 8 + 4 kept per KV head in every full-attention layer
ATOL = 1e-4
ATOL_BF16 = 0.15  # bf16 rounds every layer's output to 8 bits: measured at most 0.07 here, a mistake 1.66 or more

# bool [H_kv, T, T] per layer index (True = query row may attend to key column); set per forward
_masks: dict[int, torch.Tensor] = {}
# per layer index, (first query row, keys, values): query rows from there on read these prefix
# rows instead of the forward's own (tests/engine/test_mixed_precision.py: quantized ones)
_prefix_rows: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}


def _reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query [B, H, T, D], key / value [B, H_kv, T, D] -> output [B, T, H, D] (the library's layout)."""
    assert dropout == 0.0 and kwargs.get("softcap") is None
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    mask = _masks[module.layer_idx]  # [H_kv, T, T]
    assert mask.shape == (kv_heads, length, key.shape[2])
    scale = dim**-0.5 if scaling is None else scaling
    q = query.float().view(batch, kv_heads, group, length, dim)  # query head g * group + r reads KV head g

    def attend(key, value):
        logits = q @ key.float().unsqueeze(2).transpose(-1, -2) * scale  # [B, H_kv, G, T, T]
        logits = logits.masked_fill(~mask[None, :, None], float("-inf"))
        return logits.softmax(dim=-1) @ value.float().unsqueeze(2)  # [B, H_kv, G, T, D]

    out = attend(key, value)
    if module.layer_idx in _prefix_rows:
        first, prefix_keys, prefix_values = _prefix_rows[module.layer_idx]
        n = prefix_keys.shape[2]
        other = attend(torch.cat([prefix_keys, key[:, :, n:]], 2), torch.cat([prefix_values, value[:, :, n:]], 2))
        out[..., first:, :] = other[..., first:, :]
    return out.reshape(batch, heads, length, dim).transpose(1, 2).contiguous().to(query.dtype), None


AttentionInterface.register(REFERENCE, _reference_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(REFERENCE, sdpa_mask)  # built by the model, ignored by the reference


@pytest.fixture(scope="module")
def reference_models():
    """Deep copies of the engines' models running the reference attention (keyed by model name)."""
    made = {}

    def get(engine: Engine):
        key = (engine.loaded.name, engine.model.dtype)
        if key not in made:
            model = copy.deepcopy(engine.model)
            model.set_attn_implementation(REFERENCE)
            made[key] = model
        return made[key]

    return get


def layer_types(config) -> list[str]:
    return list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)


def build_masks(config, total: int, prefix: int, kept: dict[int, list[set[int]]] | None) -> dict[int, torch.Tensor]:
    """Per layer, [H_kv, total, total] bool. Causal everywhere; sliding layers: key j visible to
    query i iff i - sliding_window < j <= i. Full layers: the prefix (positions < prefix) sees the
    whole causal prefix (it was prefilled uncompressed); a later query sees, among prefix
    positions, only ``kept[layer][head]`` (``kept=None``: every prefix row, i.e. no compression)."""
    i = torch.arange(total)[:, None]
    j = torch.arange(total)[None, :]
    causal = j <= i
    masks = {}
    for idx, kind in enumerate(layer_types(config)):
        heads = config.num_key_value_heads
        if kind == "sliding_attention":
            mask = causal & (j > i - config.sliding_window)
            masks[idx] = mask.expand(heads, total, total)
            continue
        assert kind == "full_attention", kind
        mask = causal.repeat(heads, 1, 1)
        if kept is not None:
            for h in range(heads):
                dropped = [p for p in range(prefix) if p not in kept[idx][h]]
                mask[h, prefix:, dropped] = False
        masks[idx] = mask
    return masks


@torch.inference_mode()
def reference_logits(
    model, tokens: list[int], masks: dict, positions: torch.Tensor | None = None, prefix_rows: dict | None = None
) -> torch.Tensor:
    """Logits at every position [T, V] of one uncached forward pass with the given masks (and
    ``prefix_rows``: see :data:`_prefix_rows`)."""
    _masks.clear()
    _masks.update({k: v.to(model.device) for k, v in masks.items()})
    _prefix_rows.update(prefix_rows or {})
    try:
        ids = torch.tensor([tokens], dtype=torch.long, device=model.device)
        pos = None if positions is None else positions.unsqueeze(0).to(model.device)
        return model(input_ids=ids, position_ids=pos, use_cache=False).logits[0].float()
    finally:
        _masks.clear()
        _prefix_rows.clear()


def compressed_session(engine: Engine, prompt: list[int], monkeypatch, rest: str = "drop"):
    """A SnapKV session after its first turn, and the prefix positions each full layer's KV heads
    kept (recorded where the engine applies the selection: ``CompressedLayer.keep``); ``rest``:
    the policy's (the rows left out dropped or quantized)."""
    recorded: dict[int, torch.Tensor] = {}
    original = CompressedLayer.keep

    def keep(layer, positions, *args):
        recorded[id(layer)] = positions.detach().cpu().clone()
        return original(layer, positions, *args)

    monkeypatch.setattr(CompressedLayer, "keep", keep)
    policy = make_policy("snapkv", budget=BUDGET, window=WINDOW, kernel=3, rest=rest)
    session = engine.new_session(policy, recompress="never")  # the follow-up appends, nothing is reselected
    engine.prefill(session, prompt)
    monkeypatch.setattr(CompressedLayer, "keep", original)

    kept = {}
    for idx in full_layer_indices(session.cache):
        layer = session.cache.layers[idx]
        positions = recorded[id(layer)]  # [1, H_kv, k]: rows of the first turn = logical positions
        assert positions.shape[-1] == BUDGET + WINDOW == layer.kept_len < len(prompt)  # really compressed
        kept[idx] = [set(positions[0, h].tolist()) for h in range(positions.shape[1])]
        for rows in kept[idx]:
            assert len(rows) == BUDGET + WINDOW and set(range(len(prompt) - WINDOW, len(prompt))) <= rows
    assert sorted(kept) == [i for i, t in enumerate(layer_types(engine.model.config)) if t == "full_attention"]
    return session, kept


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_follow_up_on_a_compressed_cache_equals_a_masked_forward(
    tiny_engine: Engine, dtype, reference_models, monkeypatch
):
    """In bfloat16 too (weights, activations, KV; a one-token row takes engine/batch.py's own
    attention on a CPU), within that dtype's tolerance: the reference runs the same bf16 model."""
    if dtype == "bfloat16":
        tiny_engine = Engine(load_model(tiny_engine.loaded.name, dtype=dtype), prefill_chunk=16)
    atol = ATOL if dtype == "float32" else ATOL_BF16
    model = reference_models(tiny_engine)
    config = tiny_engine.model.config
    prompt, follow_up = random_tokens(PROMPT, seed=31), random_tokens(FOLLOW_UP, seed=32)
    transcript = prompt + follow_up
    total = len(transcript)

    session, kept = compressed_session(tiny_engine, prompt, monkeypatch)
    # the kept rows are the full-KV rows at the kept positions, per head (nothing recomputed or shifted)
    full = tiny_engine.new_session("full")
    tiny_engine.prefill(full, prompt)
    for idx, per_head in kept.items():
        for h, rows in enumerate(per_head):
            want = full.cache.layers[idx].keys[0, h, sorted(rows)]
            assert torch.equal(session.cache.layers[idx].keys[0, h], want)
    # the heads keep different rows somewhere: a per-head mask matters
    assert any(len({frozenset(r) for r in per_head}) > 1 for per_head in kept.values())

    ref = reference_logits(model, transcript, build_masks(config, total, PROMPT, kept))  # [T, V]

    # the reference attention itself is right: with every row visible it is the plain model
    plain = reference_logits(model, transcript, build_masks(config, total, PROMPT, None))
    assert (plain[-1] - tiny_engine.reference_logits(transcript)).abs().max() < atol

    # the follow-up appended at once: next-token logits
    at_once = tiny_engine.prefill(session, follow_up)
    assert session.logical_len == total and session.kept_len == BUDGET + WINDOW + FOLLOW_UP
    assert (at_once - ref[-1]).abs().max() < atol

    # the follow-up one token at a time (as decoding feeds tokens): the logits at every position
    single, kept_again = compressed_session(tiny_engine, prompt, monkeypatch)
    assert kept_again == kept
    for n, token in enumerate(follow_up):
        logits = tiny_engine.prefill(single, [token])
        assert (logits - ref[PROMPT + n]).abs().max() < atol, n

    # the reference discriminates: each of these mistakes moves the logits far beyond the tolerance
    # (measured: 1.7 to 6.3 on these presets, against at most 1e-5 for the right cache; bf16:
    # 1.66 to 6.0, against at most 0.07)
    mistakes = {
        # follow-ups that see every prefix row (the dropped ones too)
        "sees dropped rows": plain[-1],
        # each KV head reading the rows the other head kept
        "heads swapped": reference_logits(
            model, transcript, build_masks(config, total, PROMPT, {i: per_head[::-1] for i, per_head in kept.items()})
        )[-1],
        # follow-ups at physical positions (right after the kept rows) instead of logical ones
        "physical positions": reference_logits(
            model,
            transcript,
            build_masks(config, total, PROMPT, kept),
            positions=torch.cat([torch.arange(PROMPT), torch.arange(FOLLOW_UP) + BUDGET + WINDOW]),
        )[-1],
    }
    for name, wrong in mistakes.items():
        assert (wrong - ref[-1]).abs().max() > (1000 if dtype == "float32" else 8) * atol, name
