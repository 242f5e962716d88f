"""Where exactness holds: bits are equal within one kernel variant, not across variants. A session
run by a replica on this CPU's variant and handed over to one that runs another variant (or
torch's operators, as with ``KVSNAP_C_KERNELS=0``) keeps the same policy's rows (near-ties aside) and answers the
same within bf16's tolerance; handed over to the same variant it resumes bit for bit."""

from __future__ import annotations

import pytest
import torch

from kvsnap.cpu_kernels import build
from kvsnap.engine import Engine, SamplingParams, load_model
from kvsnap.engine.cache import CompressedLayer
from kvsnap.engine.defaults import default_settings
from kvsnap.policies import make_policy
from kvsnap.service.template import template_for
from kvsnap.tools.facts import facts_document, first_question

pytestmark = [pytest.mark.slow, pytest.mark.skipif(build.chosen() is None, reason="no kernel variant runs here")]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)


def _engine(variant: str | None) -> Engine:
    """A replica's engine on ``variant``: the model is loaded (packed, fused) under it."""
    with build.use(variant):
        return Engine(load_model("smollm2-135m", dtype="bfloat16"), prefill_chunk=512)


@pytest.fixture(scope="module")
def chat():
    engine = _engine(build.chosen())
    doc = facts_document(engine.tokenizer, target_tokens=900, facts=2, seed=900)
    template = template_for(engine.tokenizer)
    first = template.encode([{"role": "user", "content": first_question(doc.document, doc.facts[0].question)}], True)
    follow = template.encode([{"role": "user", "content": doc.facts[1].question}], False)
    return engine, first, follow


def _session(engine: Engine):
    settings = default_settings("smollm2-135m") | {"ratio": 0.5}  # a selection that drops rows
    policy, recompress = settings.pop("policy"), settings.pop("recompress")
    return engine.new_session(make_policy(policy, **settings), recompress=recompress)


def _resume(engine, first, follow, other: Engine, variant, monkeypatch):
    """Turn 1 on this CPU's variant; the session then handed to ``other`` (running ``variant``):
    the follow-up's prefill (its logits), answer, and the rows each compression kept there."""
    session = _session(engine)
    engine.turn(session, first, GREEDY)
    kept, keep = [], CompressedLayer.keep
    monkeypatch.setattr(
        CompressedLayer, "keep", lambda layer, rows, *rest: (kept.append(rows.clone()), keep(layer, rows, *rest))[1]
    )
    with build.use(variant):
        logits = other.prefill(session, follow[:-1]).float().flatten()
        answer = other.turn(session, follow[-1:], GREEDY)
    monkeypatch.setattr(CompressedLayer, "keep", keep)
    return logits, answer.tokens, kept


def _overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    """The share of rows two selections (``[1, H_kv, k]`` each) keep alike, head by head."""
    if a.shape != b.shape:
        return 0.0
    same = sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(a[0], b[0], strict=True))
    return same / a[0].numel()


@pytest.mark.parametrize("variant", ["generic", None])  # another variant, and torch's operators
def test_a_session_handed_to_another_variant_keeps_its_rows_and_answers_within_tolerance(chat, variant, monkeypatch):
    engine, first, follow = chat
    own = build.chosen()
    assert own != variant
    own_logits, own_tokens, own_kept = _resume(engine, first, follow, engine, own, monkeypatch)
    again_logits, again_tokens, _ = _resume(engine, first, follow, _engine(own), own, monkeypatch)
    assert torch.equal(own_logits, again_logits) and own_tokens == again_tokens  # one variant: the same bits
    logits, tokens, kept = _resume(engine, first, follow, _engine(variant), variant, monkeypatch)
    assert own_kept and len(kept) == len(own_kept)  # the follow-up compressed every full layer
    shared = [_overlap(a, b) for a, b in zip(kept, own_kept, strict=True)]
    assert min(shared) >= 0.97 and sum(shared) / len(shared) >= 0.99, shared  # the same rows but near-ties
    assert logits.argmax() == own_logits.argmax()
    assert (logits - own_logits).abs().max() <= 0.05 * own_logits.abs().max()  # bf16's drift
    assert tokens == own_tokens
