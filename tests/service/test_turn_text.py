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

from ..conftest import random_tokens


def test_templated_turns_stop_at_the_templates_turn_marker_unless_the_request_says_otherwise():
    from kvsnap.engine.models import ByteTokenizer

    api = SessionAPI(ServiceConfig(), workers=None, tokenizer=ByteTokenizer(), directory=None, metrics=None)
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


def test_a_turn_marker_the_answer_stopped_on_is_not_prefilled_again(llama_engine, directory_factory):
    """When the last answer stopped on the template's turn marker (as a stop string), the session
    holds it: the next templated turn's leading marker is not prefilled again. Here the "marker"
    is the answer's first character, made its stop string, so that the tiny model stops on it."""
    from kvsnap.actors.turns import TurnRequest

    worker = Worker(llama_engine, directory_factory(), build_store(10**8, 10**8), "w1")
    document, rest = random_tokens(40, seed=4), random_tokens(6, seed=5)
    free = worker.open("acme", "probe", document, make_policy("full"), sampling=SamplingParams(max_new_tokens=5))
    marker = free.tokens[:1]
    stop = llama_engine.decode(marker)
    assert stop and "\ufffd" not in stop
    answer = worker.open(
        "acme", "m", document, make_policy("full"), sampling=SamplingParams(max_new_tokens=5, stop=(stop,))
    )
    assert answer.finish_reason == "stop" and answer.tokens == marker  # stopped on it at once: it is pending
    sampling = SamplingParams(max_new_tokens=3)
    skipped = worker.run(TurnRequest("acme", "m", marker + rest, sampling, marker=marker))
    assert skipped.report.prompt_tokens == 1 + len(rest)  # the pending marker, then the rest: not twice
    assert worker.directory.tokens("acme", "m")[40 : 41 + len(rest)] == marker + rest
    # the same tokens after an answer that did not stop on the marker are prefilled as they are
    worker.open("acme", "n", document, make_policy("full"), sampling=SamplingParams(max_new_tokens=1))
    kept = worker.run(TurnRequest("acme", "n", marker + rest, sampling, marker=marker))
    assert kept.report.prompt_tokens == 1 + len(marker) + len(rest)


def test_templated_user_messages_start_with_the_marker_tokens():
    from kvsnap.engine.models import ByteTokenizer
    from kvsnap.service.template import encode_messages, template_for

    tok = ByteTokenizer()
    ids = encode_messages(tok, [{"role": "user", "content": "hi"}], first=False)
    marker = template_for(tok).marker
    assert marker and ids[: len(marker)] == marker
    assert tok.decode(ids) == "\nUser: hi\nAssistant:"
