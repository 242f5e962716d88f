"""recompress="reselect": every turn re-selects from the full cache kept in host memory."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from kvsnap.actors.worker import Worker
from kvsnap.engine import Engine, SamplingParams, load_model
from kvsnap.engine.batch import Row
from kvsnap.engine.cache import full_layer_indices
from kvsnap.engine.capture import WindowCapture
from kvsnap.policies import make_policy
from kvsnap.policies.snapkv import SnapKV
from kvsnap.store.tiers import build_store

from ..conftest import random_tokens

POLICY = make_policy("snapkv", budget=24, window=8, kernel=3)
SAMPLING = SamplingParams(max_new_tokens=5)


def direct_snapkv(queries: torch.Tensor, keys: torch.Tensor, scale: float, policy: SnapKV) -> torch.Tensor:
    """SnapKV written out plainly, per KV head: the rows the paper keeps, sorted. [1, H_kv, k]."""
    _, heads, w, dim = queries.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    kept = []
    for h in range(kv_heads):
        votes = torch.zeros(length - w, dtype=torch.float64)
        per_head = []
        for g in range(group):
            q = queries[0, h * group + g].double()  # [w, D]
            logits = q @ keys[0, h].double().T * scale  # [w, L]
            for i in range(w):  # window query i sits at L - w + i
                logits[i, length - w + i + 1 :] = -math.inf
            attn = logits.softmax(-1)[:, : length - w].sum(0)
            per_head.append(F.max_pool1d(attn.view(1, 1, -1), policy.kernel, 1, policy.kernel // 2).view(-1))
        votes = torch.stack(per_head).mean(0)
        top = votes.topk(policy.budget).indices
        kept.append(torch.cat([top, torch.arange(length - w, length)]).sort().values)
    return torch.stack(kept).unsqueeze(0)


def test_chunked_scoring_equals_whole_and_reads_host_keys():
    torch.manual_seed(0)
    q, keys = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 300, 16)
    whole = POLICY.score(q, keys)
    assert torch.allclose(POLICY.score(q, keys, chunk=37), whole, atol=1e-6)
    assert torch.equal(POLICY.select(q, keys, chunk=64), POLICY.select(q, keys))


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gemma3"])
def test_follow_up_keeps_exactly_snapkv_over_the_full_cache(model):
    engine = Engine(load_model(model), prefill_chunk=32)
    session = engine.new_session(POLICY, recompress="reselect")
    first = random_tokens(120, seed=1)
    engine.turn(session, first, SAMPLING)
    layers = full_layer_indices(session.cache)
    # the full copy covers what was prefilled; the answer's rows join it at the next selection
    assert session.full_len == 120 and session.logical_len == 120 + 4  # the last answer token is pending

    # the full copy of turn 1 is the uncompressed prefill: equal to a session that keeps everything
    full = engine.new_session("full")
    engine.prefill(full, first)
    for idx in layers:
        assert torch.allclose(session.full_kv[idx][0][:, :, :120], full.cache.layers[idx].keys, atol=1e-6)

    before = copy.deepcopy(session)
    question = random_tokens(20, seed=2)
    report = engine.turn(session, question, SAMPLING).report
    assert report.reselect_s > 0

    # direct computation: this turn's window queries (on the cache as it was), SnapKV over every row
    new = before.pending + question
    captured = WindowCapture(POLICY.window, set(layers))
    assert len(new) <= engine.prefill_chunk  # one packed step, as the turn's prefill ran it
    engine.step([Row(before, new, captured)])
    for idx in layers:
        appended = before.cache.layers[idx].keys[:, :, before.full_len - before.logical_len :]  # answer + new
        all_keys = torch.cat([before.full_kv[idx][0], appended], dim=-2)  # [1, H_kv, L, D]
        assert all_keys.shape[-2] == before.logical_len
        scale = captured.scales.get(idx, 1 / math.sqrt(all_keys.shape[-1]))
        expected = direct_snapkv(captured.queries[idx], all_keys, scale, POLICY)
        layer = session.cache.layers[idx]
        answer_rows = len(session.transcript) - 1 - before.logical_len  # decoded after the selection
        selected = layer.keys[:, :, : layer.kept_len - answer_rows]
        index = expected.unsqueeze(-1).expand(-1, -1, -1, all_keys.shape[-1])
        assert torch.allclose(selected, all_keys.gather(2, index), atol=1e-5), f"layer {idx}"
        assert layer.kept_len == POLICY.budget + POLICY.window + answer_rows  # device: compressed size


def test_device_bytes_stay_compressed_while_the_host_keeps_every_row(llama_engine: Engine):
    plain = llama_engine.new_session(POLICY, recompress="per_turn")
    resel = llama_engine.new_session(POLICY, recompress="reselect")
    doc = random_tokens(200, seed=3)
    for s in (plain, resel):
        llama_engine.turn(s, doc, SAMPLING)
        for k in range(3):
            llama_engine.turn(s, random_tokens(12, seed=10 + k), SAMPLING)
    assert resel.kv_bytes == plain.kv_bytes and resel.kept_len == plain.kept_len == 24 + 8 + 4
    row_bytes = 2 * 2 * 16 * 4  # (k, v) x KV heads x head dim x fp32, per full-attention layer
    assert resel.full_copy_bytes == 2 * resel.full_len * row_bytes  # 2 full-attention layers, every row
    assert resel.full_len == resel.logical_len - (SAMPLING.max_new_tokens - 1)  # but the last answer's rows


def test_worker_keeps_the_full_copy_in_the_host_tier_and_falls_back_without_it(llama_engine, directory_factory):
    worker = Worker(llama_engine, directory_factory(), build_store(10**9, 10**9), "w1")
    doc = random_tokens(150, seed=4)
    worker.open("acme", "r", doc, POLICY, "reselect", sampling=SAMPLING)
    device, host = worker.store.tiers
    assert "acme/r" in device and "acme/r/full" in host and "acme/r/full" not in device
    assert device.bytes_used < host.bytes_used  # the device holds just the selection

    result = worker.turn("acme", "r", random_tokens(10, seed=5), SAMPLING)
    assert result.source == "device" and result.report.reselect_s > 0 and worker.counters["reselect_fallbacks"] == 0
    decoded_since = SAMPLING.max_new_tokens - 1  # answer rows join the full copy at the next selection
    assert host.blobs["acme/r/full"].logical_len == result.report.logical_len - decoded_since

    worker.store.discard("acme/r/full")  # evicted: the session goes on as plain SnapKV
    result = worker.turn("acme", "r", random_tokens(10, seed=6), SAMPLING)
    assert result.report.reselect_s == 0 and worker.counters["reselect_fallbacks"] == 1
    assert result.report.kept_len == POLICY.budget + POLICY.window + SAMPLING.max_new_tokens - 1
    assert "acme/r/full" not in host

    # a replica that rebuilds the session replays its history, the fallback turn included: like the
    # uninterrupted session, it goes on as plain SnapKV (a full copy made up now would answer otherwise)
    other = Worker(llama_engine, worker.directory, build_store(10**9, 10**9), "w2")
    result = other.turn("acme", "r", random_tokens(10, seed=7), SAMPLING)
    assert result.source == "rebuilt" and result.report.reselect_s == 0 and "acme/r/full" not in other.store.tiers[1]
    assert result.report.kept_len == POLICY.budget + POLICY.window + SAMPLING.max_new_tokens - 1

    # while a session that never lost its full copy gets it back with a rebuild
    worker.open("acme", "kept", doc, POLICY, "reselect", sampling=SAMPLING)
    result = other.turn("acme", "kept", random_tokens(10, seed=8), SAMPLING)
    assert result.source == "rebuilt" and result.report.reselect_s > 0 and "acme/kept/full" in other.store.tiers[1]
    other.delete("acme", "kept")
    assert "acme/kept/full" not in other.store.tiers[1]


def test_drain_hands_the_full_copy_over_with_the_selection(llama_engine, directory_factory):
    directory = directory_factory()
    old = Worker(llama_engine, directory, build_store(10**9, 10**9), "old")
    new = Worker(llama_engine, directory, build_store(10**9, 10**9), "new")
    old.open("acme", "m", random_tokens(150, seed=8), POLICY, "reselect", sampling=SAMPLING)
    full_before = old.store.peek("acme/m/full")
    assert old.drain() == 1 and "acme/m/full" not in old.store.tiers[1]

    result = new.turn("acme", "m", random_tokens(10, seed=9), SAMPLING)
    assert result.source == "imported" and result.report.reselect_s > 0
    assert new.counters["reselect_fallbacks"] == 0
    moved = new.store.peek("acme/m/full")  # the old rows came along; this turn's rows were added
    assert moved.logical_len > full_before.logical_len
    for before, after in zip(full_before.tensors, moved.tensors, strict=True):
        assert torch.equal(after[:, :, : before.shape[2]], before)
    assert directory.take_export("acme", "m", part="full") is None  # taken, not left behind


def test_full_copy_demoted_to_disk_still_serves_reselection(llama_engine, directory_factory, tmp_path):
    # a host tier too small for the full copy: LRU pushes it down to the disk tier
    worker = Worker(llama_engine, directory_factory(), build_store(10**9, 1, 10**9, tmp_path), "w1")
    worker.open("acme", "d", random_tokens(150, seed=10), POLICY, "reselect", sampling=SAMPLING)
    assert worker.store.tier_of("acme/d/full") == "disk" and worker.store.tier_of("acme/d") == "device"
    result = worker.turn("acme", "d", random_tokens(10, seed=11), SAMPLING)
    assert result.source == "device" and result.report.reselect_s > 0
    assert worker.counters["reselect_fallbacks"] == 0 and worker.store.tier_of("acme/d/full") == "disk"


@pytest.mark.parametrize("host_budget", [10**9, 1], ids=["host", "disk"])
def test_full_copy_stays_at_full_precision_under_a_quantized_tier(
    llama_engine, directory_factory, tmp_path, host_budget
):
    """kv_quant quantizes what the host and disk tiers store, but not a re-selection session's full
    copy: its rows are scored and copied to the device every turn, so they must stay exact."""
    from kvsnap.policies.kivi import parse_kivi

    kivi = parse_kivi("kivi2", 32, 32)
    store = build_store(10**9, host_budget, 10**9, tmp_path, kivi=kivi)
    worker = Worker(llama_engine, directory_factory(), store, "w1")
    plain = Worker(llama_engine, directory_factory(), build_store(10**9, 10**9), "w2")
    for w, sid in ((worker, "q"), (plain, "p")):
        w.open("acme", sid, random_tokens(150, seed=12), POLICY, "reselect", sampling=SAMPLING)
        w.turn("acme", sid, random_tokens(10, seed=13), SAMPLING)
    assert worker.store.tier_of("acme/q/full") == ("host" if host_budget > 1 else "disk")
    stored = worker.store.peek("acme/q/full")
    want = plain.store.peek("acme/p/full")
    assert stored.layout is None and stored.exact
    for got, expected in zip(stored.tensors, want.tensors, strict=True):
        assert torch.equal(got, expected)
    # while an ordinary blob put in the same tier is quantized (lossy)
    worker.store.tiers[1].put("probe", type(want)([t.clone() for t in want.tensors], want.logical_len, 1))
    assert worker.store.tiers[1].blobs["probe"].layout is not None
