"""Decode-time eviction (H2O, Scissorhands, StreamingLLM) and KIVI-quantized tiers.

Eviction choices are checked against the papers' rules written out plainly over absolute
token ids (no tensors of rows), on random attention; the engine keeps every layer within
the evictor's capacity through long generations; KIVI round trips stay within half a
group's scale and the tiers hold the expected fraction of the bytes.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from kvsnap.engine import SamplingParams
from kvsnap.engine.cache import full_layer_indices
from kvsnap.errors import InvalidArgument
from kvsnap.policies import (
    H2O,
    POLICIES,
    Compose,
    Evictor,
    Scissorhands,
    StreamingLLM,
    evictor_names,
    make_policy,
    policy_from_json,
    policy_to_json,
    step_attention,
    window_attention,
)
from kvsnap.policies.kivi import KIVI, pack_codes, parse_kivi, unpack, unpack_codes
from kvsnap.store.tiers import DiskTier, HostTier, KVBlob, build_store

from ..conftest import random_tokens

# -- a small world of tokens with random attention ---------------------------------------------


def affinity(step: int, head: int, token: int) -> float:
    """How much step ``step``'s query of ``head`` likes ``token`` (fixed, so both sides agree)."""
    return random.Random(step * 1_000_003 + head * 7919 + token).random() ** 3


def step_attn(step: int, rows: list[list[int]]) -> torch.Tensor:
    """Attention of a step over each head's present tokens: [1, H, rows] (rows sum to 1)."""
    out = []
    for h, tokens in enumerate(rows):
        a = torch.tensor([affinity(step, h, t) for t in tokens], dtype=torch.float32)
        out.append(a / a.sum())
    return torch.stack(out).unsqueeze(0)


def window_attn(heads: int, length: int, w: int) -> torch.Tensor:
    """An observation window's causal attention: [1, H, w, L]; query i sees tokens <= L - w + i."""
    out = torch.zeros(1, heads, w, length)
    for h in range(heads):
        for i in range(w):
            seen = length - w + i + 1
            a = torch.tensor([affinity(-1 - i, h, t) for t in range(seen)])
            out[0, h, i, :seen] = a / a.sum()
    return out


def run_policy(policy: Evictor, heads: int, prompt: int, w: int, steps: int) -> list[list[list[int]]]:
    """Drive the evictor like the engine does; returns each head's token ids before every step."""
    state = policy.start(window_attn(heads, prompt, w) if policy.needs_attention else None, prompt)
    rows = [list(range(prompt)) for _ in range(heads)]
    seen = []
    for s in range(steps):
        if len(rows[0]) + 1 > policy.capacity():
            positions = policy.keep(state, len(rows[0]), 1).expand(1, heads, -1)
            rows = [[r[p] for p in positions[0, h].tolist()] for h, r in enumerate(rows)]
        for r in rows:
            r.append(prompt + s)
        seen.append([list(r) for r in rows])
        if policy.needs_attention:
            policy.observe(state, step_attn(s, rows))
    return seen


def h2o_reference(heads, prompt, w, steps, budget, recent):
    """H2O as the paper states it, per head: the running attention sum of every token; before
    a new token would overflow budget + recent, drop the lowest-sum token outside the recent."""
    seen_all = []
    wa = window_attn(heads, prompt, w)
    per_head = []
    for h in range(heads):
        tokens = list(range(prompt))
        acc = {t: float(wa[0, h, :, t].sum()) for t in tokens}
        history = []
        for s in range(steps):
            while len(tokens) + 1 > budget + recent:
                victim = min(tokens[:-recent], key=lambda t: acc[t])
                tokens.remove(victim)
            tokens.append(prompt + s)
            acc[prompt + s] = 0.0
            history.append(list(tokens))
            a = step_attn(s, [tokens] * (h + 1))[0, h]
            for t, x in zip(tokens, a.tolist(), strict=True):
                acc[t] += x
        per_head.append(history)
    for s in range(steps):
        seen_all.append([per_head[h][s] for h in range(heads)])
    return seen_all


def scissorhands_reference(heads, prompt, w, steps, budget, recent, history, drop):
    """Scissorhands as the paper states it, per head: a token's count = steps within the last
    ``history`` where it got less than that step's average attention; when a new token would
    overflow, drop ceil(drop * budget) non-recent tokens with the highest counts (ties: less
    attention in those steps goes first)."""
    wa = window_attn(heads, prompt, w)
    per_head = []
    for h in range(heads):
        tokens = list(range(prompt))
        steps_seen = []  # per step: {token: (low, attention)}
        for i in range(w):
            n = prompt - w + i + 1
            steps_seen.append({t: (float(wa[0, h, i, t]) < 1 / n, float(wa[0, h, i, t])) for t in range(n)})
        out = []
        for s in range(steps):
            if len(tokens) + 1 > budget + recent:
                recent_steps = steps_seen[-history:]
                n_drop = min(max(math.ceil(drop * budget), len(tokens) + 1 - budget - recent), len(tokens) - recent)

                def badness(t, recent_steps=recent_steps):
                    low = sum(st[t][0] for st in recent_steps if t in st)
                    attn = sum(st[t][1] for st in recent_steps if t in st)
                    return low - attn / (len(recent_steps) + 1)

                victims = set(sorted(tokens[:-recent], key=badness, reverse=True)[:n_drop])
                tokens = [t for t in tokens if t not in victims]
            tokens.append(prompt + s)
            out.append(list(tokens))
            a = step_attn(s, [tokens] * (h + 1))[0, h].tolist()
            steps_seen.append({t: (x < 1 / len(tokens), x) for t, x in zip(tokens, a, strict=True)})
        per_head.append(out)
    return [[per_head[h][s] for h in range(heads)] for s in range(steps)]


def test_h2o_evicts_like_the_papers_rule():
    policy = H2O(window=4, budget=6)
    got = run_policy(policy, heads=3, prompt=10, w=4, steps=40)
    assert got == h2o_reference(3, 10, 4, 40, budget=6, recent=4)
    assert all(len(r) <= policy.capacity() for step in got for r in step)


def test_scissorhands_evicts_like_the_papers_rule():
    policy = Scissorhands(window=3, budget=8, history=6, drop=0.5)
    got = run_policy(policy, heads=2, prompt=12, w=3, steps=50)
    assert got == scissorhands_reference(2, 12, 3, 50, budget=8, recent=3, history=6, drop=0.5)
    sizes = [len(step[0]) for step in got]
    assert max(sizes) <= policy.capacity()
    assert min(sizes[5:]) == policy.capacity() - math.ceil(0.5 * 8) + 1  # a batch of 4 goes at once


def test_streaming_keeps_sinks_and_the_most_recent_while_decoding():
    policy = StreamingLLM(window=5, sinks=2)
    got = run_policy(policy, heads=2, prompt=7, w=5, steps=30)
    for s, step in enumerate(got):
        for tokens in step:
            newest = 7 + s
            assert tokens == [0, 1] + list(range(max(2, newest - 4), newest + 1))
            assert len(tokens) <= 7


@pytest.mark.parametrize("name", ["h2o", "scissorhands", "streaming"])
def test_every_evictor_keeps_its_recent_rows_and_capacity(name):
    policy = make_policy(name, window=4, budget=5) if name != "streaming" else make_policy(name, window=4, sinks=3)
    for steps in (1, 13, 37):
        for step in run_policy(policy, heads=2, prompt=20, w=4, steps=steps):
            for tokens in step:
                newest = tokens[-1]
                assert tokens[-4:] == list(range(newest - 3, newest + 1))  # the recent rows, always
                assert len(tokens) <= policy.capacity()


def test_h2o_prefill_selection_is_the_accumulated_window_attention():
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 4, 6, 8, generator=g), torch.randn(1, 2, 40, 8, generator=g)
    policy = H2O(window=6, budget=10)
    attn = window_attention(q, k).mean(dim=2)  # [1, H_kv, w, L]
    want = attn.sum(dim=2)[..., :34]
    torch.testing.assert_close(policy.score(q, k), want)
    kept = policy.select(q, k)
    for h in range(2):
        top = set(want[0, h].topk(10).indices.tolist()) | set(range(34, 40))
        assert set(kept[0, h].tolist()) == top


def test_scissorhands_prefill_keeps_the_rows_least_often_below_average():
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 2, 5, 8, generator=g) * 3, torch.randn(1, 1, 30, 8, generator=g)
    policy = Scissorhands(window=5, budget=9)
    attn = window_attention(q, k).mean(dim=2)[0, 0]  # [w, L]
    counts, sums = [], []
    for j in range(25):
        counts.append(sum(float(attn[i, j]) < 1 / (25 + i + 1) for i in range(5)))
        sums.append(float(attn[:, j].sum()))
    order = sorted(range(25), key=lambda j: (counts[j], -sums[j]))
    assert set(policy.select(q, k)[0, 0].tolist()) == set(order[:9]) | set(range(25, 30))


def test_step_attention_is_one_softmax_row_per_group():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 6, 1, 4, generator=g), torch.randn(1, 2, 9, 4, generator=g)
    got = step_attention(q, k, scale=0.3)
    for h in range(2):
        rows = [(k[0, h] @ q[0, h * 3 + i, 0] * 0.3).softmax(0) for i in range(3)]
        torch.testing.assert_close(got[0, h], torch.stack(rows).mean(0))


def test_compose_pairs_a_prefill_policy_with_a_decoder_and_round_trips():
    policy = make_policy("snapkv", budget=64, window=8, decode={"policy": "scissorhands", "budget": 16, "window": 4})
    assert isinstance(policy, Compose) and policy.window == 8 and policy.budget == 64
    assert policy.decoder() == Scissorhands(window=4, budget=16)
    assert policy_from_json(policy_to_json(policy)) == policy
    assert "scissorhands" in policy.fingerprint() and "snapkv" in policy.fingerprint()
    assert make_policy("snapkv").decoder() is None and make_policy("h2o").decoder() == make_policy("h2o")
    assert {"h2o", "scissorhands", "streaming"} <= set(evictor_names())
    assert set(evictor_names()) == {n for n, cls in POLICIES.items() if issubclass(cls, Evictor)}


@pytest.mark.parametrize(
    "name,params,match",
    [
        ("snapkv", {"decode": {"policy": "snapkv"}}, "decode policy must evict"),
        ("snapkv", {"decode": {"budget": 3}}, "naming its policy"),
        ("snapkv", {"decode": {"policy": "h2o", "kernel": 3}}, "no parameter"),
        ("h2o", {"ratio": 0.5}, "fixed number of rows"),
        ("scissorhands", {"drop": 0.0}, "drop must be"),
        ("scissorhands", {"history": 0}, "history must be"),
    ],
)
def test_bad_decode_policies(name, params, match):
    with pytest.raises(InvalidArgument, match=match):
        make_policy(name, **params)


# -- the engine keeps every layer within capacity through a long generation -------------------

DECODERS = {
    "h2o": make_policy("h2o", budget=12, window=6),
    "scissorhands": make_policy("scissorhands", budget=12, window=4, history=20),
    "streaming": make_policy("streaming", window=10, sinks=4),
    "snapkv+h2o": make_policy("snapkv", budget=24, window=8, kernel=3, decode={"policy": "h2o", "budget": 8}),
}


@pytest.mark.parametrize("label", DECODERS)
def test_long_generation_never_exceeds_the_decoders_capacity(tiny_engine, label, monkeypatch):
    monkeypatch.setattr(tiny_engine, "eos_ids", ())  # random weights: generate the whole length
    policy = DECODERS[label]
    decoder = policy.decoder()
    session = tiny_engine.new_session(policy)
    for prompt in (random_tokens(90, 1), random_tokens(20, 2)):
        stream = tiny_engine.stream(session, prompt, SamplingParams(max_new_tokens=120))
        most = 0
        for n, _ in enumerate(stream):  # the first token goes out before the prompt's compression
            if n:
                most = max(most, *(session.cache.layers[i].kept_len for i in full_layer_indices(session.cache)))
        assert most <= decoder.capacity()
        assert stream.report.generated_tokens == 120
        assert session.logical_len + len(session.pending) == len(session.transcript)
        assert stream.report.kept_len <= decoder.capacity() < stream.report.logical_len


def test_an_evictor_with_room_for_everything_decodes_exactly_like_full_kv(llama_engine):
    prompt = random_tokens(40, 3)
    roomy = make_policy("full", window=4, decode={"policy": "h2o", "budget": 400, "window": 4})
    a = llama_engine.turn(llama_engine.new_session(roomy), prompt, SamplingParams(max_new_tokens=30))
    b = llama_engine.turn(llama_engine.new_session("full"), prompt, SamplingParams(max_new_tokens=30))
    assert a.tokens == b.tokens


def test_reselect_does_not_combine_with_decode_time_eviction(llama_engine):
    with pytest.raises(InvalidArgument, match="reselect"):
        llama_engine.new_session(make_policy("h2o"), recompress="reselect")


# -- KIVI ------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("per", ["channel", "token"])
def test_kivi_round_trip_error_is_at_most_half_a_step(bits, per):
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(1, 2, 150, 64, generator=g) * torch.linspace(0.1, 8, 64)  # outlier channels
    kivi = KIVI(bits=bits, group=32, residual=20)
    parts, meta = kivi.quantize(x, per)
    packed, scale, zero, residual = parts
    q_rows = meta["rows"]
    assert q_rows == 128 and residual.shape[2] == 150 - 128 and torch.equal(residual, x[:, :, 128:])
    if per == "channel":  # one scale per channel for each group of 32 tokens
        assert scale.shape == (1, 2, 4, 1, 64)
        step = scale.float().expand(1, 2, 4, 32, 64).reshape(1, 2, 128, 64)
    else:  # one scale per token for each group of 32 channels
        assert scale.shape == (1, 2, 128, 2, 1)
        step = scale.float().expand(1, 2, 128, 2, 32).reshape(1, 2, 128, 64)
    y = unpack(parts, [meta | {"parts": 4}])[0]
    err = (y[:, :, :q_rows] - x[:, :, :q_rows]).abs()
    assert (err <= step / 2 + 1e-5).all()
    # and the stored step is the group's range over the levels (up to float16 rounding)
    grouped = x[:, :, :q_rows].reshape(1, 2, 4, 32, 64) if per == "channel" else None
    if grouped is not None:
        span = (grouped.amax(3, keepdim=True) - grouped.amin(3, keepdim=True)) / (2**bits - 1)
        torch.testing.assert_close(scale.float(), span, rtol=3e-3, atol=1e-3)
    assert packed.numel() == 2 * 128 * 64 * bits // 8
    assert err.mean() < (0.3 if bits == 4 else 1.5) * step.mean()  # not just bounded: close on average


def test_kivi_packs_codes_losslessly():
    codes = torch.randint(0, 4, (1001,), dtype=torch.uint8)
    assert torch.equal(unpack_codes(pack_codes(codes, 2), 2, 1001), codes)
    codes = torch.randint(0, 16, (999,), dtype=torch.uint8)
    assert torch.equal(unpack_codes(pack_codes(codes, 4), 4, 999), codes)


def expected_bytes(shape, kivi: KIVI, element: int = 4) -> int:
    batch, heads, rows, dim = shape
    q = kivi.quantized_rows(rows)
    codes = batch * heads * q * dim * kivi.bits // 8
    groups = batch * heads * q * dim // kivi.group
    return codes + 2 * 2 * groups + batch * heads * (rows - q) * dim * element


@pytest.mark.parametrize("bits", [2, 4])
def test_quantized_host_and_disk_tiers_hold_the_expected_bytes(tmp_path, bits):
    kivi = KIVI(bits=bits, group=32, residual=32)
    tensors = [torch.randn(1, 2, 544, 64) for _ in range(4)]
    blob = KVBlob(tensors, logical_len=544, version=3)
    want = sum(expected_bytes(t.shape, kivi) for t in tensors)
    # per value: 4 bytes (fp32) vs bits/8 + two fp16 per 32-value group; the last 32 rows stay fp32.
    # Exact (the byte counts are integers; 544 * 4 / (512 * 3 / 8 + 128) = 6.8 for 2 bits, 4.533.. for 4)
    ratio = 544 * 4 / (512 * (bits / 8 + 4 / 32) + 32 * 4)
    assert blob.nbytes / want == pytest.approx(ratio, rel=1e-12)
    for i, tier in enumerate((HostTier(10**9, kivi), DiskTier(10**9, tmp_path / f"d{bits}", kivi))):
        tier.put("s", blob)
        assert tier.bytes_used == want and blob.nbytes / tier.bytes_used == pytest.approx(ratio, rel=1e-12)
        back = tier.read("s")
        assert back.layout is None and back.logical_len == 544 and back.version == 3
        assert all(b.shape == t.shape and b.dtype == t.dtype for b, t in zip(back.tensors, tensors, strict=True))
        for n, (b, t) in enumerate(zip(back.tensors, tensors, strict=True)):
            # the residual rows come back bit for bit; a quantized value is off by at most half a
            # step of its group (keys: a channel over 32 tokens; values: a token over 32 channels)
            assert torch.equal(b[:, :, 512:], t[:, :, 512:]), (i, n)
            err = (b[:, :, :512] - t[:, :, :512]).abs()
            bound = half_step(t[:, :, :512], "channel" if n % 2 == 0 else "token", bits, 32)
            assert (err <= bound).all(), (i, n, float((err - bound).max()))
            assert err.mean() > 0.1 * bound.mean()  # and it really was quantized
    assert blob.nbytes / want > (6.5 if bits == 2 else 4.5)


def half_step(x: torch.Tensor, per: str, bits: int, group: int) -> torch.Tensor:
    """Per value of ``x`` [B, H, L, D] (L a multiple of ``group``): half the quantization step of
    its group, (max - min) / (2**bits - 1) / 2, widened for the float16 storage of the scale and
    zero point (kivi._grid): the zero point lies at most 1.5 * 2**-10 * |min| below the group's
    minimum and the scale is rounded up by less than a factor 1 + 2**-9, so the step is at most
    (max - min + 1.5 * 2**-10 * |min|) / levels * (1 + 2**-9); 1e-5 covers float32 arithmetic.
    Measured, the largest error reaches 0.999 of this bound: it is tight."""
    levels = 2**bits - 1
    b, h, rows, d = x.shape
    g = x.reshape(b, h, rows // group, group, d) if per == "channel" else x.reshape(b, h, rows, d // group, group)
    axis = 3 if per == "channel" else 4
    lo, hi = g.amin(dim=axis, keepdim=True), g.amax(dim=axis, keepdim=True)
    step = (hi - lo + lo.abs() * 1.5 * 2**-10) / levels * (1 + 2**-9)
    return (step / 2 + 1e-5).expand_as(g).reshape(b, h, rows, d)


def test_a_packed_blob_moves_down_the_tiers_without_requantizing(tmp_path):
    kivi = KIVI(bits=2)
    store = build_store(1, 10**9, 10**9, tmp_path, kivi=kivi)  # device holds nothing: host at once
    blob = KVBlob([torch.randn(1, 2, 300, 32) for _ in range(2)], logical_len=300, version=1)
    store.put("a", blob)
    assert store.tier_of("a") == "host"
    host_copy = store.tiers[1].blobs["a"]
    store.tiers[1].budget = 0  # push it to the disk tier
    store._enforce_budgets()
    assert store.tier_of("a") == "disk"
    on_disk = store.tiers[2].take("a", raw=True)
    assert on_disk.layout == host_copy.layout
    assert all(torch.equal(a, b) for a, b in zip(on_disk.tensors, host_copy.tensors, strict=True))
    store.tiers[2].put("a", on_disk)
    got = store.get("a")  # handed back dequantized, whichever tier it lands in
    assert got is not None and got.layout is None
    want = KVBlob(host_copy.tensors, 300, 1, "", host_copy.layout).unpacked()
    assert all(torch.equal(a, b) for a, b in zip(got.tensors, want.tensors, strict=True))


def test_parse_kivi():
    assert parse_kivi("none") is None
    assert parse_kivi("kivi4", group=16, residual=8) == KIVI(bits=4, group=16, residual=8)
    with pytest.raises(InvalidArgument):
        parse_kivi("kivi3")
    with pytest.raises(InvalidArgument):
        KIVI(bits=3)


def test_worker_serves_a_session_from_a_quantized_host_tier(llama_engine, directory_factory):
    """SnapKV keeps fewer rows, KIVI stores them in fewer bits: the host tier holds exactly the
    packed bytes of the selection, and the next turn resumes from it."""
    from kvsnap.actors.worker import Worker

    kivi = KIVI(bits=4, group=16, residual=8)
    policy = make_policy("snapkv", budget=48, window=8, kernel=3)
    sampling = SamplingParams(max_new_tokens=4)
    quantized = Worker(llama_engine, directory_factory(), build_store(1, 10**9, kivi=kivi), "wq")
    plain = Worker(llama_engine, directory_factory(), build_store(1, 10**9), "wp")
    doc = random_tokens(200, seed=21)
    for worker in (quantized, plain):
        worker.open(worker.worker_id, "q", doc, policy, "per_turn", sampling=sampling)
        assert worker.store.tier_of(f"{worker.worker_id}/q") == "host"  # the device tier holds nothing
    selection = plain.store.tiers[1].blobs["wp/q"].tensors
    assert all(t.shape[2] == 48 + 8 + 3 for t in selection)  # SnapKV's rows (+ the answer so far)
    assert quantized.store.tiers[1].bytes_used == sum(expected_bytes(t.shape, kivi) for t in selection)
    assert plain.store.tiers[1].bytes_used / quantized.store.tiers[1].bytes_used > 2.5

    dequantized = quantized.store.peek("wq/q").tensors
    for got, want in zip(dequantized, selection, strict=True):
        assert (got - want).abs().max() <= (want.amax() - want.amin()) / 15  # a 4-bit step at most
    follow_up = random_tokens(10, seed=22)
    a, b = (w.turn(w.worker_id, "q", follow_up, sampling) for w in (quantized, plain))
    assert a.source == b.source == "host"
    assert (a.report.logical_len, a.report.kept_len) == (b.report.logical_len, b.report.kept_len)
