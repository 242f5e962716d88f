"""Sentence spans: a selection with ``spans=True`` keeps a span whole or not at all (a fact is a
span of tokens), on the policies' own selection and through the engine."""

from __future__ import annotations

import torch

from kvsnap.engine import SamplingParams
from kvsnap.engine.models import ByteTokenizer
from kvsnap.engine.spans import MAX_SPAN, layer_spans, span_ends, span_ids
from kvsnap.policies import make_policy
from kvsnap.policies.base import span_best

TOK = ByteTokenizer()
ENDS = span_ends(TOK, 320)


def test_spans_end_at_sentence_punctuation_special_tokens_and_max_length():
    ids = span_ids(ENDS, TOK.encode("Ab. Cd! E\nfg", add_special_tokens=True))
    # BOS (special) ends its own span; "Ab." ; " Cd!" ; " E\n" ; "fg"
    assert ids.tolist() == [0, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 4, 4]
    long = span_ids(ENDS, TOK.encode("x" * (2 * MAX_SPAN + 3), add_special_tokens=False), first=5)
    assert long.tolist() == [5] * MAX_SPAN + [6] * MAX_SPAN + [7] * 3
    both = layer_spans(ENDS, 3, TOK.encode("a. b", add_special_tokens=False))
    assert both.tolist() == [0, 1, 2, 3, 3, 4, 4]  # rows kept from earlier turns: one span each


def test_span_best_rates_each_row_by_its_spans_best_row():
    scores = torch.tensor([[[0.1, 0.9, 0.2, 0.3, 0.05, 0.4]]])
    spans = torch.tensor([0, 0, 1, 1, 1, 2])
    assert torch.equal(span_best(scores, spans), torch.tensor([[[0.9, 0.9, 0.3, 0.3, 0.3, 0.4]]]))


def _whole_spans(kept: torch.Tensor, spans: torch.Tensor, prefix: int) -> int:
    """How many spans of the prefix a head's kept rows cut (keep some rows of, not all)."""
    chosen = set(kept.tolist())
    cut = 0
    for s in spans[:prefix].unique().tolist():
        rows = set((spans[:prefix] == s).nonzero().flatten().tolist())
        cut += 0 < len(rows & chosen) < len(rows)
    return cut


def test_snapkv_with_spans_keeps_spans_whole_but_for_the_last_one_chosen():
    torch.manual_seed(0)
    length, window = 400, 8
    text = "".join(f"Fact {i} says {torch.randint(10**4, 10**5, ()).item()}. " for i in range(30))
    spans = span_ids(ENDS, TOK.encode(text, add_special_tokens=False)[:length])
    queries, keys = torch.randn(1, 4, window, 16), torch.randn(1, 2, length, 16)
    plain = make_policy("snapkv", budget=96, window=window, kernel=3)
    spanned = make_policy("snapkv", budget=96, window=window, kernel=3, spans=True)
    assert spanned.keeps_spans and not plain.keeps_spans
    kept = spanned.select(queries, keys, spans=spans)
    for head in range(2):
        assert kept.shape[-1] == 96 + window
        assert _whole_spans(kept[0, head], spans, length - window) <= 1
    plain_kept = plain.select(queries, keys)
    assert max(_whole_spans(plain_kept[0, h], spans, length - window) for h in range(2)) > 1  # what spans fix


def test_scored_policy_with_spans_keeps_spans_whole():
    torch.manual_seed(1)
    n, window = 300, 16
    text = "".join(f"The code of item {i} is {1000 + 37 * i}. " for i in range(20))
    spans = span_ids(ENDS, TOK.encode(text, add_special_tokens=False)[:n])
    policy = make_policy("kvzip", ratio=0.3, window=window, kernel=1, spans=True)
    kept = policy.keep_scored(torch.randn(1, 2, n), n, spans=spans)
    for head in range(2):
        assert _whole_spans(kept[0, head], spans, n - window) <= 1


def test_engine_selects_by_spans_and_a_rebuild_replays_it_exactly(llama_engine):
    """Through the engine (tiny Llama, byte tokens): a spans session's greedy answers equal those
    of its rebuild from the token log, turn by turn, and its rows differ from plain SnapKV's."""
    doc = "".join(f"Item {i} has the code {31 * i + 1000}. " for i in range(40))
    sampling = SamplingParams(max_new_tokens=6)
    spanned = llama_engine.new_session(make_policy("snapkv", budget=120, window=8, spans=True))
    plain = llama_engine.new_session(make_policy("snapkv", budget=120, window=8))
    turns = [llama_engine.encode(doc + "Which code? "), llama_engine.encode(" And item 7? ", first=False)]
    answers = [llama_engine.turn(spanned, t, sampling).tokens for t in turns]
    for t in turns:
        llama_engine.turn(plain, t, sampling)
    assert spanned.kept_len == plain.kept_len  # same budget
    rows = [layer.keys for layer in spanned.cache.layers]
    assert any(not torch.equal(a, b.keys) for a, b in zip(rows, plain.cache.layers, strict=True))
    rebuilt = llama_engine.new_session(spanned.policy)
    llama_engine.rebuild(rebuilt, list(spanned.transcript), spanned.logical_len, list(spanned.marks))
    for a, b in zip(rebuilt.cache.layers, spanned.cache.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys)
    assert all(len(a) == 6 for a in answers)


def test_the_span_table_from_the_fast_tokenizers_batch_is_the_one_decoding_each_token_gives():
    from kvsnap.engine.models import tokenizer_for
    from kvsnap.engine.spans import ENDS as PUNCTUATION

    tok = tokenizer_for("smollm2-135m")  # converted once into ~/.cache/kvsnap, as test_chat_template's
    table = span_ends(tok, len(tok))  # the backend's own batch
    texts = tok.batch_decode([[i] for i in range(len(tok))], skip_special_tokens=False)
    slow = bytearray(any(c in text for c in PUNCTUATION) for text in texts)
    for special in tok.all_special_ids:
        slow[special] = 1
    assert table == bytes(slow)
    assert 100 < sum(table) < len(tok) // 2  # punctuation tokens, specials: some, far from all
