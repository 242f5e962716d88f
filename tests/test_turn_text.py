"""The text of a turn: the plain template's turn marker is a default stop string, and what the
message log keeps of an answer is what the caller got back (cut at its stop string)."""

from __future__ import annotations

from kvsnap.actors.worker import Worker
from kvsnap.engine import SamplingParams
from kvsnap.policies import make_policy
from kvsnap.service.api import SessionAPI
from kvsnap.service.config import ServiceConfig
from kvsnap.service.template import TURN_MARKER, segment
from kvsnap.store.tiers import build_store

from .conftest import random_tokens


def test_templated_turns_stop_at_the_templates_turn_marker_unless_the_request_says_otherwise():
    api = SessionAPI(ServiceConfig(), workers=None, tokenizer=None, directory=None, metrics=None)
    assert TURN_MARKER == "\nUser:" and segment({"role": "user", "content": "q"}).startswith(TURN_MARKER)
    assert api.sampling({}, template=True).stop == (TURN_MARKER,)
    assert api.sampling({"stop": None}, template=True).stop == (TURN_MARKER,)
    assert api.sampling({}, template=False).stop == ()  # raw text: no template, no marker
    assert api.sampling({"stop": []}, template=True).stop == ()  # asked for none
    assert api.sampling({"stop": "END"}, template=True).stop == ("END",)


def test_the_message_log_keeps_the_answer_as_returned(llama_engine, directory_factory):
    worker = Worker(llama_engine, directory_factory(), build_store(10**8, 10**8), "w1")
    document = random_tokens(40, seed=3)
    free = worker.open("acme", "free", document, make_policy("full"), sampling=SamplingParams(max_new_tokens=12))
    stop = free.text[len(free.text) // 2 :][:2]  # a string the greedy answer is known to contain
    assert stop and stop in free.text
    cut = free.text[: free.text.find(stop)]
    answer = worker.open(
        "acme",
        "cut",
        document,
        make_policy("full"),
        sampling=SamplingParams(max_new_tokens=12, stop=(stop,)),
        log=[{"role": "prompt", "content": "doc"}],
        answer_role="completion",
    )
    assert answer.finish_reason == "stop"
    assert worker.messages("acme", "cut") == [
        {"role": "prompt", "content": "doc"},
        {"role": "completion", "content": cut},
    ]


def test_a_turn_marker_the_session_holds_already_is_skipped(llama_engine, directory_factory):
    """When the last answer stopped on the template's turn marker, the session holds it: the next
    templated turn's leading marker tokens are not prefilled again (here the "marker" is the last
    generated token, so that the tiny model's answer is known to end with it)."""
    from kvsnap.actors.turns import TurnRequest

    worker = Worker(llama_engine, directory_factory(), build_store(10**8, 10**8), "w1")
    sampling = SamplingParams(max_new_tokens=5)
    answer = worker.open("acme", "m", random_tokens(40, seed=4), make_policy("full"), sampling=sampling)
    marker = answer.tokens[-1:]  # pending in the transcript, as a stopped-on marker is
    rest = random_tokens(6, seed=5)
    skipped = worker.run(TurnRequest("acme", "m", marker + rest, sampling, marker=marker))
    assert skipped.report.prompt_tokens == 1 + len(rest)  # the pending token, then the rest: no second marker
    assert answer.finish_reason == "length"  # so the marker (the last token) is pending, not in the KV
    end = 40 + len(answer.tokens)
    assert worker.directory.tokens("acme", "m")[end - 1 : end + len(rest)] == marker + rest  # once
    # a marker the session does not end with is prefilled as usual
    other = [t for t in random_tokens(3, seed=6) if t != skipped.tokens[-1]][:1]
    kept = worker.run(TurnRequest("acme", "m", other + rest, sampling, marker=other))
    assert kept.report.prompt_tokens == 1 + len(other) + len(rest)


def test_templated_user_messages_start_with_the_marker_tokens():
    from kvsnap.engine.models import ByteTokenizer
    from kvsnap.service.template import encode_messages, marker_ids

    tok = ByteTokenizer()
    ids = encode_messages(tok, [{"role": "user", "content": "hi"}], first=False)
    assert ids[: len(marker_ids(tok))] == marker_ids(tok)
    assert tok.decode(ids) == "\nUser: hi\nAssistant:"
