"""A request that departs from its session's history is served from the last turn boundary it
shares: the session goes back to the end of that turn, replayed from its token log as a rebuild
replays it (each turn prefilled and compressed where it ran, so the compressed KV is exactly
the one the session had there), and the turns after it are replaced by the new one."""

from __future__ import annotations

import functools

import openai
import pytest
import requests
import torch

from kvsnap.actors.turns import TurnRequest, turn_boundaries
from kvsnap.actors.worker import Worker
from kvsnap.engine import Engine, SamplingParams, load_model
from kvsnap.engine.session import TurnMark
from kvsnap.errors import Conflict
from kvsnap.policies import make_policy
from kvsnap.service.template import encode_messages
from kvsnap.store.tiers import build_store

DOC = "Foxes are small omnivorous mammals. The pass key is 48213. Foxes live in dens and hunt at night. " * 3
SNAPKV = {"policy": "snapkv", "budget": 16, "window": 4, "kernel": 3}


def user(q: str) -> dict:
    return {"role": "user", "content": q}


def test_turn_boundaries_come_from_the_messages_each_turn_logged():
    def marks(*counts: int) -> list[TurnMark]:
        return [TurnMark(1, 1, 2, messages=n) for n in counts]

    doc, a, sys = (
        {"role": "document", "content": "d"},
        {"role": "assistant", "content": "a"},
        user("s") | {"role": "system"},
    )
    assert turn_boundaries([doc, user("q"), a, user("r"), a], marks(1, 2, 2)) == [1, 3, 5]  # opened with a document
    # a turn that brought its own system prompt, or an edited answer: counted, not guessed from roles
    assert turn_boundaries([doc, sys, user("q"), a], marks(1, 3)) == [1, 4]
    assert turn_boundaries([sys, user("q"), a, user("x"), a, user("r"), a], marks(5, 2)) == [5, 7]
    assert turn_boundaries([doc, user("q"), a], marks(1, 1)) == []  # the counts do not add up: no rewinds
    assert turn_boundaries([doc, user("q"), a], [TurnMark(1, 0, 1), *marks(2)]) == []  # a mark from before counts


def test_a_client_that_leaves_out_an_empty_answer_continues_its_session():
    from kvsnap.service.matching import with_empty_answers

    sys, a = {"role": "system", "content": "doc"}, {"role": "assistant", "content": "A"}
    empty = {"role": "assistant", "content": ""}
    stored = [sys, user("q1"), empty, user("q2"), a]
    sent = [sys, user("q1"), user("q2"), a, user("q3")]  # aiperf's history: no empty assistant message
    assert with_empty_answers(sent, stored) == [*stored, user("q3")]
    assert with_empty_answers(stored + [user("q3")], stored) == [*stored, user("q3")]  # unchanged
    edited = [sys, user("q1"), user("other"), user("q3")]
    assert with_empty_answers(edited, stored) == edited  # a real departure stays one
    assert with_empty_answers([sys, user("q1")], stored) == [sys, user("q1")]  # shorter: left as sent


def _conversation(worker: Worker, tok, sid: str, questions: list[str], policy) -> list:
    """A session opened with DOC, then one turn per question; the turns' results."""
    doc = [{"role": "document", "content": DOC}]
    worker.open("acme", sid, encode_messages(tok, doc, True), policy, log=doc)
    sampling = SamplingParams(max_new_tokens=5)
    return [
        worker.turn(
            "acme", sid, encode_messages(tok, [user(q)], False), sampling, log=[user(q)], answer_role="assistant"
        )
        for q in questions
    ]


def test_a_worker_takes_a_compressed_session_back_to_a_turn_boundary_exactly(llama_engine, directory_factory):
    directory = directory_factory()
    worker = Worker(llama_engine, directory, build_store(10**8, 10**8), "w-rewind")
    twin = Worker(llama_engine, directory, build_store(10**8, 10**8), "w-twin")
    tok, policy = llama_engine.tokenizer, make_policy("snapkv", budget=16, window=4, kernel=3)
    _conversation(worker, tok, "s", ["What is the pass key?", "Where do foxes live?", "When do they hunt?"], policy)
    want = _conversation(twin, tok, "t", ["What is the pass key?", "Do foxes swim?", "Say the key again."], policy)
    before = directory.get("acme", "s")
    assert before.turns == 4

    question = user("Do foxes swim?")
    two_turns = sum(m.prompt + m.generated for m in directory.marks("acme", "s")[:2])  # the document, turn 1
    stale = TurnRequest(
        "acme", "s", encode_messages(tok, [question], False), SamplingParams(max_new_tokens=5),
        log=[question], answer_role="assistant", expected_version=before.version - 1, keep_turns=2,
    )  # fmt: skip
    with pytest.raises(Conflict):  # built on an older version: refused, nothing changed
        worker.run(stale)
    with pytest.raises(Conflict, match="cannot be taken back"):  # not a boundary before the end
        worker.run(
            TurnRequest("acme", "s", stale.tokens, stale.sampling, expected_version=before.version, keep_turns=4)
        )
    assert directory.get("acme", "s").version == before.version

    rewound = worker.run(
        TurnRequest(
            "acme",
            "s",
            stale.tokens,
            stale.sampling,
            log=[question],
            answer_role="assistant",
            expected_version=before.version,
            keep_turns=2,
        )  # fmt: skip
    )
    assert rewound.source == "rewound" and rewound.tokens == want[1].tokens
    assert rewound.report.replayed_tokens == two_turns > 0
    after = directory.get("acme", "s")
    assert after.version == before.version + 1 and after.turns == 3
    # the logs are the twin's: tokens, marks, messages (the replaced turns are gone)
    assert directory.tokens("acme", "s") == directory.tokens("acme", "t")[: after.log_len]
    assert directory.marks("acme", "s") == directory.marks("acme", "t")[:3]
    assert [m["content"] for m in directory.messages("acme", "s")] == [
        m["content"] for m in directory.messages("acme", "t")[:5]
    ]
    assert worker.held["acme/s"].entry.logical_len == directory.marks("acme", "t")[2].logical_len
    # it goes on as the twin did, from its device tier, and then holds the twin's KV bit for bit
    again = worker.turn(
        "acme", "s", encode_messages(tok, [user("Say the key again.")], False), SamplingParams(max_new_tokens=5)
    )
    assert again.source == "device" and again.tokens == want[2].tokens
    mine, theirs = worker.sessions.tiers.get("acme/s"), twin.sessions.tiers.get("acme/t")
    assert mine.logical_len == theirs.logical_len and len(mine.tensors) == len(theirs.tensors) > 0
    assert all(torch.equal(a, b) for a, b in zip(mine.tensors, theirs.tensors, strict=True))


def test_a_rewind_that_cannot_commit_leaves_the_session_as_it_was(llama_engine, directory_factory, monkeypatch):
    """Another writer got there first: the rewritten logs are not written, the stored session
    (tokens, marks, messages, version) is the one before, and its next turn is served from it."""
    directory = directory_factory()
    worker = Worker(llama_engine, directory, build_store(10**8, 10**8), "w-fail")
    tok = llama_engine.tokenizer
    _conversation(worker, tok, "f", ["What is the pass key?", "Where do foxes live?"], make_policy("full"))

    def stored():
        return directory.get("acme", "f").version, directory.tokens("acme", "f"), directory.marks("acme", "f")

    before = stored() + (directory.messages("acme", "f"),)
    question = user("Do foxes swim?")
    tokens = encode_messages(tok, [question], False)

    def taken(*args, **kwargs):
        raise Conflict("session 'f' was updated concurrently")

    monkeypatch.setattr(directory, "rewrite", taken)
    with pytest.raises(Conflict):
        worker.run(
            TurnRequest(
                "acme",
                "f",
                tokens,
                SamplingParams(max_new_tokens=5),
                log=[question],
                answer_role="assistant",
                expected_version=before[0],
                keep_turns=2,
            )  # fmt: skip
        )
    monkeypatch.undo()
    assert stored() + (directory.messages("acme", "f"),) == before
    later = worker.turn("acme", "f", tokens, SamplingParams(max_new_tokens=5), log=[question], answer_role="assistant")
    assert later.source == "rebuilt" and directory.get("acme", "f").turns == 4  # appended after the old turns


def _chat(client, sid: str, messages: list[dict], **kvsnap):
    return client.chat.completions.with_raw_response.create(
        model="tiny-llama",
        messages=messages,
        max_tokens=5,
        extra_headers={"x-session-id": sid},
        extra_body={"kvsnap": SNAPKV | kvsnap},
    )


def test_a_diverging_chat_is_served_from_the_last_shared_turn(service, llama_engine):
    """Through the OpenAI route: the client edits its last question (a new branch); the answer
    equals a session that took that branch from the start, and only the new message is prefilled
    (the shared turns are replayed from the log, reported as ``replayed_tokens``)."""
    client = openai.OpenAI(base_url=f"{service.http}/v1", api_key="key-alpha")
    tok = llama_engine.tokenizer

    def converse(sid: str, questions: list[str]) -> list[dict]:
        messages = [{"role": "system", "content": DOC}]
        for q in questions:
            messages.append(user(q))
            raw = _chat(client, sid, messages)
            messages.append({"role": "assistant", "content": raw.parse().choices[0].message.content})
        return messages

    asked = converse("rw-a", ["What is the pass key?", "Where do foxes live?"])
    branch = converse("rw-b", ["What is the pass key?", "Do foxes swim?"])  # the branch, taken from the start
    edited = [*asked[:3], user("Do foxes swim?")]
    headers = {"Authorization": "Bearer key-alpha"}
    state = requests.get(f"{service.http}/v1/sessions/rw-a", headers=headers).json()

    refused = requests.post(
        f"{service.http}/v1/chat/completions",
        headers=headers | {"x-session-id": "rw-a"},
        json={"model": "m", "messages": edited, "max_tokens": 5, "kvsnap": SNAPKV | {"history": "strict"}},
    )
    assert refused.status_code == 409 and "strict" in refused.json()["error"]["message"]
    assert requests.get(f"{service.http}/v1/sessions/rw-a", headers=headers).json() == state  # untouched

    raw = _chat(client, "rw-a", edited)
    answer, extra = raw.parse(), raw.http_response.json()["kvsnap"]
    assert answer.choices[0].message.content == branch[-1]["content"]
    assert extra["source"] == "rewound" and extra["replayed_tokens"] > 0
    assert answer.usage.prompt_tokens == len(encode_messages(tok, [user("Do foxes swim?")], False)) + 1
    assert raw.http_response.headers["x-session-id"] == "rw-a"
    now = requests.get(f"{service.http}/v1/sessions/rw-a", headers=headers).json()
    assert now["turns"] == 2 and now["version"] == state["version"] + 1

    # the conversation goes on from the new branch, as the twin's does
    follow = [*branch, user("And the key?")]
    got = _chat(client, "rw-a", follow).parse().choices[0].message.content
    assert got == _chat(client, "rw-b", follow).parse().choices[0].message.content


def test_a_diverging_completion_prompt_is_served_from_the_last_shared_turn(service):
    """``/v1/completions``: a prompt that keeps the first prompt and completion but not the
    second turn goes back to the end of the first; one that keeps nothing is refused."""
    client = openai.OpenAI(base_url=f"{service.http}/v1", api_key="key-alpha")

    def complete(sid: str, prompt: str):
        raw = client.completions.with_raw_response.create(
            model="tiny-llama", prompt=prompt, max_tokens=4, extra_headers={"x-session-id": sid},
            extra_body={"kvsnap": SNAPKV},
        )  # fmt: skip
        return raw.parse().choices[0].text, raw.http_response.json()["kvsnap"]

    first, _ = complete("rwc-a", DOC)
    complete("rwc-a", DOC + first + " Where?")
    twin_first, _ = complete("rwc-b", DOC)
    assert twin_first == first
    want, _ = complete("rwc-b", DOC + first + " Who?")
    got, extra = complete("rwc-a", DOC + first + " Who?")
    assert got == want and extra["source"] == "rewound"

    def refused(prompt: str, **kvsnap) -> str:
        r = requests.post(
            f"{service.http}/v1/completions",
            headers={"Authorization": "Bearer key-alpha", "x-session-id": "rwc-a"},
            json={"model": "m", "prompt": prompt, "max_tokens": 2, "kvsnap": kvsnap},
        )
        assert r.status_code == 409, r.text
        return r.json()["error"]["message"]

    assert "shares no whole turn" in refused("Something else entirely.")  # nothing to go back to: kept as it is
    assert "strict" in refused(DOC + first + " Why?", history="strict")
    assert complete("rwc-a", DOC + first + " Why?")[1]["replayed_tokens"] > 0  # still there: turn 1 replayed
    # the last prompt repeated and its answer re-formatted: the answer's rows cut off, nothing replayed
    again = complete("rwc-a", DOC + first + " Why? Really?")[1]
    assert again["source"] == "rewound" and again["replayed_tokens"] == 0


@functools.cache
def _engine(name: str) -> Engine:
    return Engine(load_model(name), prefill_chunk=16)


def _raw(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


@pytest.mark.parametrize(
    ("engine_name", "policy", "cut"),
    [
        ("llama_engine", {"name": "snapkv", "budget": 16, "window": 4, "kernel": 3}, True),
        ("llama_engine", {"name": "full"}, True),
        ("llama_engine", {"name": "snapkv", "budget": 16, "window": 4, "kernel": 3, "decode": "h2o:8"}, False),
        ("tiny-gemma3", {"name": "snapkv", "budget": 16, "window": 4, "kernel": 3}, False),
    ],
)
def test_a_prompt_kept_with_its_answer_reformatted_is_exactly_the_prompt_prefilled_alone(
    request, directory_factory, engine_name, policy, cut
):
    """A raw session goes back to the end of its last turn's prompt (the request repeats that
    prompt and re-formats the answer, as a client flattening a conversation does). Where that
    is exact the held KV loses its answer's rows (nothing replayed): an all-full-attention model
    whose policy does not evict while decoding. Elsewhere (Gemma 3's sliding-window layers, a
    decode-time evictor) the turns are replayed. Either way the session then equals a twin that
    prefilled the same prompt without answering it: same tokens, logs and KV bit for bit."""
    engine = request.getfixturevalue(engine_name) if engine_name.endswith("engine") else _engine(engine_name)
    directory = directory_factory()
    worker = Worker(engine, directory, build_store(10**8, 10**8), "w-cut")
    twin = Worker(engine, directory, build_store(10**8, 10**8), "w-cut-twin")
    tok, five = engine.tokenizer, SamplingParams(max_new_tokens=5)
    params = {k: v for k, v in policy.items() if k != "name"}
    if "decode" in params:
        kind, budget = params.pop("decode").split(":")
        params["decode"] = {"policy": kind, "budget": int(budget)}
    pol = make_policy(policy["name"], **params)

    def raw(text: str, **kw) -> dict:
        return {"log": [{"role": "prompt", "content": text}], "answer_role": "completion", **kw}

    first = worker.open("acme", "p", _raw(tok, DOC), pol, sampling=five, **raw(DOC))
    worker.turn("acme", "p", _raw(tok, " Where?"), five, **raw(" Where?"))
    again = twin.open("acme", "q", _raw(tok, DOC), pol, sampling=five, **raw(DOC))
    assert again.tokens == first.tokens
    twin.run(TurnRequest("acme", "q", _raw(tok, " Where?"), None, **raw(" Where?", answer_role=None)))
    flat = "\n" + worker.engine.decode(first.tokens) + "\n Who?"  # the answer re-formatted, a new question
    want = twin.turn("acme", "q", _raw(tok, flat), five, **raw(flat))

    before = directory.get("acme", "p")
    with pytest.raises(Conflict, match="cannot be taken back to the prompt"):  # turn 3 does not exist
        worker.run(TurnRequest("acme", "p", _raw(tok, flat), five, expected_version=before.version, keep_turns=2,
                               keep_prompt=True))  # fmt: skip
    got = worker.run(
        TurnRequest("acme", "p", _raw(tok, flat), five, expected_version=before.version, keep_turns=1,
                    keep_prompt=True, **raw(flat))
    )  # fmt: skip
    assert got.source == "rewound" and got.tokens == want.tokens
    assert worker.sessions.counters["answers_cut"] == int(cut)
    two_prompts = len(_raw(tok, DOC)) + len(first.tokens) + len(_raw(tok, " Where?"))
    assert got.report.replayed_tokens == (0 if cut else two_prompts)
    assert got.report.prompt_tokens == want.report.prompt_tokens == len(_raw(tok, flat))
    assert directory.tokens("acme", "p") == directory.tokens("acme", "q")
    assert directory.marks("acme", "p") == directory.marks("acme", "q")
    assert directory.messages("acme", "p") == directory.messages("acme", "q")
    mine, theirs = worker.sessions.tiers.get("acme/p"), twin.sessions.tiers.get("acme/q")
    assert mine.logical_len == theirs.logical_len
    assert all(torch.equal(a, b) for a, b in zip(mine.tensors, theirs.tensors, strict=True))
