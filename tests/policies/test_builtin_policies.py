"""SnapKV's math against a reference written straight from the paper's formulas, and the
contract every registered policy keeps."""

from __future__ import annotations

import math

import pytest
import torch

from kvsnap.errors import InvalidArgument
from kvsnap.policies import POLICIES, FullKV, ScoredPolicy, SnapKV, StreamingLLM, make_policy


def reference_scores(q, k, window, kernel, pooling, gqa_reduce):
    """Loops over heads and window queries: softmax over every visible key, sum on the prefix,
    pool along the sequence, then reduce within each KV group."""
    batch, heads, w, dim = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    group = heads // kv_heads
    prefix = length - w
    out = torch.empty(batch, kv_heads, prefix, dtype=torch.float64)
    for b in range(batch):
        per_head = []
        for h in range(heads):
            keys = k[b, h // group].double()
            votes = torch.zeros(prefix, dtype=torch.float64)
            for i in range(w):
                visible = prefix + i + 1  # query i sits at position prefix + i
                logits = keys[:visible] @ q[b, h, i].double() / math.sqrt(dim)
                votes += logits.softmax(0)[:prefix]
            pooled = torch.empty(prefix, dtype=torch.float64)
            half = kernel // 2
            for j in range(prefix):
                span = votes[max(0, j - half) : min(prefix, j + half + 1)]
                pooled[j] = span.max() if pooling == "max" else span.mean()
            per_head.append(pooled)
        stacked = torch.stack(per_head).view(kv_heads, group, prefix)
        out[b] = stacked.mean(1) if gqa_reduce == "mean" else stacked.amax(1)
    return out


@pytest.mark.parametrize("pooling", ["max", "avg"])
@pytest.mark.parametrize("gqa_reduce", ["mean", "max"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (6, 1)])
def test_snapkv_scores_match_reference(pooling, gqa_reduce, heads, kv_heads):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    length, window, dim = 50, 6, 8
    q = torch.randn(2, heads, window, dim, generator=g) * 2
    k = torch.randn(2, kv_heads, length, dim, generator=g) * 2
    policy = SnapKV(window=window, budget=10, kernel=5, pooling=pooling, gqa_reduce=gqa_reduce)
    got = policy.scores(q, k)
    want = reference_scores(q, k, window, 5, pooling, gqa_reduce)
    assert got.shape == (2, kv_heads, length - window)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_snapkv_select_keeps_budget_window_and_a_top_k():
    g = torch.Generator().manual_seed(7)
    length, window, budget = 80, 8, 12
    q = torch.randn(1, 4, window, 16, generator=g)
    k = torch.randn(1, 2, length, 16, generator=g)
    policy = SnapKV(window=window, budget=budget, kernel=3)
    kept = policy.select(q, k)
    scores = policy.scores(q, k)
    assert kept.shape == (1, 2, budget + window)
    for h in range(2):
        rows = kept[0, h]
        assert torch.equal(rows, rows.sort().values) and rows.unique().numel() == rows.numel()
        assert rows[-window:].tolist() == list(range(length - window, length))  # the window is always kept
        prefix_kept = rows[:-window]
        dropped = torch.ones(length - window, dtype=torch.bool)
        dropped[prefix_kept] = False
        # a top-k: nothing dropped scores above anything kept (ties may go either way)
        assert scores[0, h, prefix_kept].min() >= scores[0, h, dropped].max()


def test_snapkv_leaves_short_prompts_alone():
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 20, 8)
    assert SnapKV(window=4, budget=16).select(q, k).shape[-1] == 20  # 20 <= 16 + 4
    assert SnapKV(window=4, budget=15).select(q, k).shape[-1] == 19


def test_snapkv_ratio_budget():
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 104, 8)
    assert SnapKV(window=4, ratio=0.25).select(q, k).shape[-1] == 25 + 4
    # ratio sizes against the tokens seen, not against rows already kept
    assert SnapKV(window=4, ratio=0.25).select(q, k, logical_len=404).shape[-1] == 100 + 4


def test_a_floor_keeps_a_short_prefix_whole_and_a_long_one_at_its_share():
    q = torch.randn(1, 2, 4, 8)
    floored = SnapKV(window=4, ratio=0.25, floor=50)
    assert floored.select(q, torch.randn(1, 2, 44, 8)).shape[-1] == 44  # 40 rows <= the floor: all stay
    assert not floored.compresses(54) and floored.compresses(56)
    assert floored.select(q, torch.randn(1, 2, 104, 8)).shape[-1] == 50 + 4  # 25 by the share, 50 by the floor
    assert floored.select(q, torch.randn(1, 2, 404, 8)).shape[-1] == 100 + 4  # the share is the larger
    # a share of a threshold's count too: kvzap keeps at least the floor's rows, its best by score
    scores = torch.full((1, 1, 40), -10.0)
    scores[0, 0, 20] = 5.0
    kept = make_policy("kvzap", tau=0.0, window=4, floor=3).keep_scored(scores, 40)[0, 0].tolist()
    assert len(kept) == 3 + 4 and 20 in kept
    # a wrapper (a decode-time composition, re-selection) selects with its policy's floor
    composed = make_policy("snapkv", ratio=0.25, floor=50, decode={"policy": "h2o", "budget": 8})
    assert composed.floor == 50 and composed.prefix_budget(40) == 50


def test_streaming_keeps_sinks_and_recent():
    q, k = torch.randn(1, 2, 8, 8), torch.randn(1, 2, 40, 8)
    kept = StreamingLLM(window=8, sinks=4).select(q, k)
    assert kept[0, 0].tolist() == [0, 1, 2, 3] + list(range(32, 40))


# the built-in policies: this file is collected before test_policy_plugin.py (alphabetical order),
# whose import registers keep_every
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_contract(name):
    """Every policy: sorted unique rows, window kept, at most budget + window rows."""
    policy = make_policy(name, window=4)
    g = torch.Generator().manual_seed(3)
    for length in (4, 10, 600):
        q, k = torch.randn(1, 4, 4, 8, generator=g), torch.randn(1, 2, length, 8, generator=g)
        if isinstance(policy, ScoredPolicy):  # rated by the engine (a scratch pass, a surrogate), not a window
            kept = policy.keep_scored(torch.randn(1, 2, length, generator=g), length)
        else:
            kept = policy.select(q, k)
        for rows in kept[0]:
            assert torch.equal(rows, rows.sort().values) and rows.unique().numel() == rows.numel()
            assert set(range(length - 4, length)) <= set(rows.tolist())
        if policy.compresses_anything:
            assert kept.shape[-1] == min(length, policy.prefix_budget(length - 4) + 4)
        else:
            assert kept.shape[-1] == length
    assert policy.fingerprint().startswith(f"{name}(")


@pytest.mark.parametrize("name", ["kvzip", "kvzap"])
def test_scored_policies_keep_a_peaks_neighbours_and_count_by_its_own_scores(name):
    """kernel 5: a lone high score keeps its 2 neighbours each side; kernel 1: only itself.
    With ``tau`` the count is the rows above it by their own scores, not the pooled ones, and
    by default nothing is pooled."""
    scores = torch.full((1, 1, 40), -10.0)
    scores[0, 0, 20] = 5.0  # one peak in the prefix (rows 0-35; the last 4 are the window)
    scores[0, 0, 5] = 4.0
    pooled = make_policy(name, budget=5, window=4, kernel=5).keep_scored(scores, 40)[0, 0].tolist()
    assert set(range(18, 23)) <= set(pooled) and set(range(36, 40)) <= set(pooled) and len(pooled) == 9
    alone = make_policy(name, budget=2, window=4, kernel=1).keep_scored(scores, 40)[0, 0].tolist()
    assert alone == [5, 20, 36, 37, 38, 39]
    above = make_policy(name, tau=0.0, window=4, kernel=5).keep_scored(scores, 40)[0, 0].tolist()
    assert len(above) == 2 + 4 and set(above[:2]) <= set(range(18, 23))  # 2 rows above tau; chosen pooled
    assert make_policy(name, tau=0.0, window=4).keep_scored(scores, 40)[0, 0].tolist() == [5, 20, 36, 37, 38, 39]
    assert make_policy(name, window=4).pool() == 15 and make_policy(name, tau=1.0).pool() == 1  # the defaults
    with pytest.raises(InvalidArgument, match="kernel must be odd"):
        make_policy(name, kernel=4)


def test_full_never_compresses():
    assert not FullKV().compresses(10_000)


@pytest.mark.parametrize(
    "params,match",
    [
        ({"budget": 0}, "budget must be >= 1"),
        ({"window": 0}, "window must be >= 1"),
        ({"kernel": 4}, "kernel must be odd"),
        ({"pooling": "median"}, "pooling must be"),
        ({"gqa_reduce": "sum"}, "gqa_reduce must be"),
        ({"ratio": 1.5}, "ratio must be"),
        ({"floor": 64}, "give a ratio with it"),  # a budget is a count already
        ({"ratio": 0.5, "floor": -1}, "floor must be >= 0"),
        ({"budget": 2.5}, "budget must be an integer"),
        ({"bogus": 1}, "no parameter"),
    ],
)
def test_bad_policy_parameters(params, match):
    with pytest.raises(InvalidArgument, match=match):
        make_policy("snapkv", **params)


def test_unknown_policy_lists_valid_names():
    # keep_every: a test's own policy (test_policy_plugin.py), registered when that module ran
    listed = "valid policies: full, h2o, (keep_every, )?kvzap, kvzip, scissorhands, snapkv, streaming"
    with pytest.raises(InvalidArgument, match=listed):
        make_policy("h3o")


def test_gather_rows_picks_each_heads_rows_from_views_in_place():
    """gather_rows equals torch.gather over whole rows, for a tensor of its own, a cache layer's
    rows in use (a view of a larger buffer) and a layout whose rows are not contiguous."""
    from kvsnap.policies import gather_rows

    gen = torch.Generator().manual_seed(2)
    buf = torch.randn(2, 3, 50, 8, generator=gen)
    for states in (
        buf,
        buf[:, :, 5:40],
        buf[:, 1:, :30],
        buf[..., :4],
        buf.transpose(2, 3).contiguous().transpose(2, 3),
    ):
        _, heads, length, dim = states.shape
        positions = torch.stack([torch.randperm(length, generator=gen)[:7].sort().values for _ in range(2 * heads)])
        positions = positions.view(2, heads, 7)
        want = states.gather(2, positions.unsqueeze(-1).expand(-1, -1, -1, dim))
        assert torch.equal(gather_rows(states, positions), want)


def test_window_attention_is_each_query_heads_causal_softmax():
    """The observation window's attention per query head (grouped-query heads sharing a KV head),
    against a plain float64 computation."""
    from kvsnap.policies.base import window_attention

    gen = torch.Generator().manual_seed(4)
    q, k = torch.randn(1, 6, 5, 16, generator=gen), torch.randn(1, 2, 40, 16, generator=gen)
    got = window_attention(q, k, scale=0.25)  # [1, 2, 3, 5, 40]
    kk = k.double().repeat_interleave(3, dim=1)  # query head h reads KV head h // 3
    logits = (q.double() @ kk.transpose(-1, -2)) * 0.25  # [1, 6, 5, 40]
    logits[..., 35:] = logits[..., 35:].masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    want = logits.softmax(-1).view(1, 2, 3, 5, 40)
    assert got.shape == want.shape and torch.allclose(got.double(), want, atol=1e-6)


@pytest.mark.parametrize("scale", [0.125, 1 / math.sqrt(80)])
def test_window_attention_and_a_selection_are_those_of_the_plain_operators_bit_for_bit(scale):
    """A power-of-two scale goes on the queries (every product and sum scales exactly), another
    one on the logits; a CPU selection comes in order from a mask instead of a sort: the same
    logits, scores and rows, bit for bit, as the plain products, scaling and sort."""
    from kvsnap.policies.base import span_best, window_attention

    gen = torch.Generator().manual_seed(8)
    policy = make_policy("snapkv", ratio=0.75, window=8, kernel=3, spans=True)
    for trial in range(6):
        q = (torch.randn(1, 9, 8, 64, generator=gen) * (1 + trial)).bfloat16()
        keys = torch.randn(1, 3, 300, 64, generator=gen).bfloat16()[:, :, :290]  # a view, as a cache's rows
        logits = torch.matmul(q.float().reshape(1, 3, 24, 64), keys.float().transpose(-1, -2))
        logits = logits.view(1, 3, 3, 8, 290) * scale
        logits[..., 282:].masked_fill_(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
        assert torch.equal(window_attention(q, keys, scale), logits.softmax(dim=-1))
        spans = torch.arange(290) // (1 + trial)
        scores = span_best(policy.score(q, keys, scale), spans[:282])
        prefix = scores.topk(policy.prefix_budget(282), dim=-1).indices
        tail = torch.arange(282, 290).expand(1, 3, 8)
        want = torch.cat([prefix, tail], dim=-1).sort(dim=-1).values
        assert torch.equal(policy.select(q, keys, scale, spans=spans), want)
