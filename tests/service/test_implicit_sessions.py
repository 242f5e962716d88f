"""Implicit sessions: a chat request without a session header that repeats a conversation and
adds to it resumes the session holding that conversation (matched by content, within the
tenant), so that only the new messages are prefilled. Real service, real openai client."""

from __future__ import annotations

import asyncio
import uuid
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

from kvsnap.actors.turns import TurnRequest
from kvsnap.engine import SamplingParams
from kvsnap.errors import Conflict
from kvsnap.policies import make_policy
from kvsnap.service.matching import resume_or_open
from kvsnap.service.template import encode_messages
from kvsnap.store.conversations import conversation_digests, text_digests
from kvsnap.store.directory import SessionDirectory

from ..conftest import random_tokens
from .helpers import DOC, FULL, QUESTIONS


def ask(service, messages, key="key-alpha", **kvsnap) -> dict:
    r = requests.post(
        f"{service.http}/v1/chat/completions",
        headers=service.headers(key),
        json={"model": "tiny-llama", "messages": messages, "max_tokens": 6, "kvsnap": FULL | kvsnap},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert r.headers["x-session-id"] == body["kvsnap"]["session_id"]  # the session used, to pin if wanted
    return body


def test_the_openai_client_without_a_session_header_resumes_its_conversation(service, llama_engine):
    client = openai.OpenAI(base_url=f"{service.http}/v1", api_key="key-alpha")
    doc = f"{DOC} Conversation {uuid.uuid4().hex}."
    messages = [{"role": "system", "content": doc}]
    sessions, prefilled, finished = [], [], []
    for i, q in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": q})
        # no stop string: an answer ends on its token limit or on EOS, which tells the pending token
        response = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=6, stop=[])
        extra = response.model_extra["kvsnap"]
        sessions.append(extra["session_id"])
        prefilled.append(response.usage.prompt_tokens)
        finished.append(response.choices[0].finish_reason)
        assert extra["source"] == ("new" if i == 0 else "device")
        messages.append({"role": "assistant", "content": response.choices[0].message.content})
    assert len(set(sessions)) == 1  # one session all along
    tok = llama_engine.tokenizer
    for i, q in enumerate(QUESTIONS[1:], start=1):
        # only the new message, and the last answer's last token when it is pending: an answer cut
        # at its token limit has not fed it to the model yet; one that ended on EOS has
        pending = finished[i - 1] == "length"
        assert prefilled[i] == len(encode_messages(tok, [{"role": "user", "content": q}], False)) + pending
    state = SessionDirectory(service.redis_url).get("alpha", sessions[0])
    assert state.turns == len(QUESTIONS)


def test_another_tenant_sending_the_same_conversation_gets_a_session_of_its_own(service):
    doc = f"{DOC} Tenant test {uuid.uuid4().hex}."
    first = [{"role": "system", "content": doc}, {"role": "user", "content": QUESTIONS[0]}]
    a1 = ask(service, first)
    follow = [*first, {"role": "assistant", "content": a1["choices"][0]["message"]["content"]}]
    follow.append({"role": "user", "content": QUESTIONS[1]})
    theirs = ask(service, follow, key="key-beta")
    directory = SessionDirectory(service.redis_url)
    assert theirs["kvsnap"]["session_id"] != a1["kvsnap"]["session_id"] and theirs["kvsnap"]["source"] == "new"
    assert directory.get("beta", theirs["kvsnap"]["session_id"]) is not None
    assert directory.get("alpha", a1["kvsnap"]["session_id"]).turns == 1  # alpha's session untouched
    assert conversation_digests("alpha", "-", follow) != conversation_digests("beta", "-", follow)  # other keys
    ours = ask(service, follow)
    assert ours["kvsnap"]["session_id"] == a1["kvsnap"]["session_id"] and ours["kvsnap"]["source"] == "device"


def test_session_none_and_a_changed_history_open_a_new_session(service):
    doc = f"{DOC} Opt-out test {uuid.uuid4().hex}."
    first = [{"role": "system", "content": doc}, {"role": "user", "content": QUESTIONS[0]}]
    a1 = ask(service, first)
    follow = [*first, {"role": "assistant", "content": a1["choices"][0]["message"]["content"]}]
    follow.append({"role": "user", "content": QUESTIONS[1]})
    assert ask(service, follow, session="none")["kvsnap"]["source"] == "new"
    edited = [*first, {"role": "assistant", "content": "something else"}, {"role": "user", "content": QUESTIONS[1]}]
    assert ask(service, edited)["kvsnap"]["source"] == "new"  # no session holds that history: a new one
    bad = requests.post(
        f"{service.http}/v1/chat/completions",
        headers=service.headers(),
        json={"model": "tiny-llama", "messages": follow, "kvsnap": {"session": "sometimes"}},
    )
    assert bad.status_code == 400


def test_a_turn_built_on_an_older_version_is_refused(llama_engine, directory_factory):
    from kvsnap.actors.worker import Worker
    from kvsnap.store.tiers import build_store

    worker = Worker(llama_engine, directory_factory(), build_store(10**8, 10**8), "w1")
    worker.open("acme", "v", random_tokens(30, seed=1), make_policy("full"), sampling=SamplingParams(max_new_tokens=2))
    version = worker.directory.get("acme", "v").version
    worker.turn("acme", "v", [5, 6], SamplingParams(max_new_tokens=2))  # someone else's turn came first
    with pytest.raises(Conflict, match="changed since"):
        worker.stream(TurnRequest("acme", "v", [7], SamplingParams(max_new_tokens=2), expected_version=version))


def test_a_refused_resumption_gives_way_to_the_next_match_then_to_a_new_session():
    async def refused():
        raise Conflict("another turn on this session is in progress")
        yield  # an async generator

    async def answer(text):
        yield {"text": text}
        yield {"done": True}

    async def run(attempts, used):
        return [e async for e in resume_or_open(attempts, lambda: answer("fresh"), used, "new-one")]

    used = {"sid": "busy"}
    events = asyncio.run(run([("busy", refused), ("free", lambda: answer("resumed"))], used))
    assert events == [{"text": "resumed"}, {"done": True}] and used["sid"] == "free"
    used = {"sid": "busy"}
    events = asyncio.run(run([("busy", refused), ("also-busy", refused)], used))
    assert events == [{"text": "fresh"}, {"done": True}] and used["sid"] == "new-one"


def test_the_session_header_names_are_configuration(service):
    assert service.cfg.session_headers == ["x-session-id", "x-session-affinity"]  # the defaults
    sid = f"affinity-{uuid.uuid4().hex[:8]}"
    first = [{"role": "system", "content": DOC}, {"role": "user", "content": QUESTIONS[0]}]

    def post(messages):
        r = requests.post(
            f"{service.http}/v1/chat/completions",
            headers=service.headers() | {"X-Session-Affinity": sid},  # as load tools send it
            json={"model": "tiny-llama", "messages": messages, "max_tokens": 4, "kvsnap": FULL},
        )
        assert r.status_code == 200 and r.headers["x-session-id"] == sid, r.text
        return r.json()

    a1 = post(first)
    again = post([*first, {"role": "assistant", "content": a1["choices"][0]["message"]["content"]}, first[1]])
    assert a1["kvsnap"]["session_id"] == again["kvsnap"]["session_id"] == sid
    assert again["kvsnap"]["source"] == "device"


def _conversation(service, key="key-alpha", **body):
    doc = f"{DOC} {uuid.uuid4().hex}."
    first = [{"role": "system", "content": doc}, {"role": "user", "content": QUESTIONS[0]}]
    r = requests.post(
        f"{service.http}/v1/chat/completions",
        headers=service.headers(key) | body.pop("headers", {}),
        json={"model": "tiny-llama", "messages": first, "max_tokens": 4, "kvsnap": FULL} | body,
    )
    assert r.status_code == 200, r.text
    answer = r.json()
    follow = [*first, {"role": "assistant", "content": answer["choices"][0]["message"]["content"]}]
    return answer, [*follow, {"role": "user", "content": QUESTIONS[1]}]


def test_sessions_named_by_their_clients_are_never_resumed_by_content(service):
    named = f"named-{uuid.uuid4().hex[:8]}"
    answer, follow = _conversation(service, headers={"x-session-id": named})
    assert answer["kvsnap"]["session_id"] == named
    other = ask(service, follow)  # the same conversation, no header: not the named session
    assert other["kvsnap"]["session_id"] != named and other["kvsnap"]["source"] == "new"


def test_openai_users_of_one_key_keep_their_own_conversations(service):
    a1, follow = _conversation(service, user="ann")
    assert ask(service, follow)["kvsnap"]["source"] == "new"  # no user: another scope
    resumed = requests.post(
        f"{service.http}/v1/chat/completions",
        headers=service.headers(),
        json={"model": "tiny-llama", "messages": follow, "max_tokens": 4, "kvsnap": FULL, "user": "ann"},
    ).json()
    assert resumed["kvsnap"]["session_id"] == a1["kvsnap"]["session_id"]


def test_a_conversation_several_sessions_hold_lists_them_newest_first(service):
    directory = SessionDirectory(service.redis_url)
    messages = [
        {"role": "system", "content": f"x {uuid.uuid4().hex}"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    ]
    directory.register_conversation("alpha", "-", "one", messages)
    assert directory.match_conversation("alpha", "-", [*messages, {"role": "user", "content": "q2"}]) == ["one"]
    directory.register_conversation("alpha", "-", "one", messages)  # the same session again: still it, once
    assert directory.match_conversation("alpha", "-", messages) == ["one"]
    for n in range(2, 7):  # other sessions, the same words: the newest four are kept
        directory.register_conversation("alpha", "-", f"s{n}", messages)
    assert directory.match_conversation("alpha", "-", messages) == ["s6", "s5", "s4", "s3"]
    longer = [*messages, {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
    directory.register_conversation("alpha", "-", "one", longer)
    assert directory.match_conversation("alpha", "-", longer) == ["one", "s6", "s5", "s4", "s3"]  # the longest first
    assert directory.match_conversation("beta", "-", messages) == []
    assert directory.match_conversation("alpha", "u:ann", messages) == []


def test_identical_conversations_each_resume_a_session(service, llama_engine):
    """Two users of one key send the same chat (a "summarize this" button): each follow-up
    resumes a session holding that conversation, both at once too, and a third chat repeating
    it after both moved on opens its own."""
    doc = f"{DOC} Same words {uuid.uuid4().hex}."
    first = [{"role": "system", "content": doc}, {"role": "user", "content": QUESTIONS[0]}]
    one, two = ask(service, first), ask(service, first)
    assert one["kvsnap"]["source"] == two["kvsnap"]["source"] == "new"
    sids = {one["kvsnap"]["session_id"], two["kvsnap"]["session_id"]}
    answer = one["choices"][0]["message"]["content"]
    assert two["choices"][0]["message"]["content"] == answer  # greedy, the same prompt
    follow = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": QUESTIONS[1]}]
    with ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda _: ask(service, follow), range(2)))
    assert {b["kvsnap"]["session_id"] for b in both} == sids  # one each, though sent at once
    assert all(b["kvsnap"]["source"] != "new" for b in both)
    doc_tokens = len(llama_engine.tokenizer.encode(doc))
    assert all(b["usage"]["prompt_tokens"] < doc_tokens // 2 for b in both)  # only the new messages prefilled
    third = ask(service, follow)  # both sessions hold a longer conversation now
    assert third["kvsnap"]["source"] == "new" and third["kvsnap"]["session_id"] not in sids


def complete(service, prompt: str, key: str = "key-alpha", **kvsnap) -> dict:
    r = requests.post(
        f"{service.http}/v1/completions",
        headers=service.headers(key),
        json={"model": "tiny-llama", "prompt": prompt, "max_tokens": 6, "ignore_eos": True, "kvsnap": SNAPKV | kvsnap},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert r.headers["x-session-id"] == body["kvsnap"]["session_id"]
    return body


SNAPKV = {"policy": "snapkv", "budget": 32, "window": 4, "kernel": 3}


def test_completions_without_a_header_resume_the_session_whose_text_they_repeat(service, llama_engine):
    """A client that flattens its conversation into one prompt (aiperf's template endpoint: the
    turns joined by newlines) re-formats each answer. The session is found by its text and goes
    back to the end of the last prompt: the answer's rows are cut off (tiny-llama has no
    sliding-window layers), and only the separator, the answer and the new question are
    prefilled. A prompt that extends the text exactly resumes it as it is."""
    tok = llama_engine.tokenizer
    first = f"{DOC} Flattened {uuid.uuid4().hex}.\nQ: {QUESTIONS[0]}\nA:"
    one = complete(service, first)
    sid, c1 = one["kvsnap"]["session_id"], one["choices"][0]["text"]
    assert one["kvsnap"]["source"] == "new" and c1
    added = f"\n{c1}\nQ: {QUESTIONS[1]}\nA:"
    two = complete(service, first + added)
    assert two["kvsnap"]["session_id"] == sid and two["kvsnap"]["source"] == "rewound"
    assert two["kvsnap"]["replayed_tokens"] == 0
    assert two["usage"]["prompt_tokens"] == len(tok.encode(added, add_special_tokens=False))
    c2 = two["choices"][0]["text"]
    three = complete(service, first + added + c2 + " And?")  # extends the text as it was returned
    assert three["kvsnap"]["session_id"] == sid and three["kvsnap"]["source"] == "device"
    # only the new text, and the last answer's last token unless it was fed already (an answer
    # whose last token is EOS feeds it; the random model draws one now and then)
    assert three["usage"]["prompt_tokens"] - len(tok.encode(" And?", add_special_tokens=False)) in (0, 1)
    directory = SessionDirectory(service.redis_url)
    version = directory.get("alpha", sid).version
    # the log: the first prompt (its answer dropped), then the turns that replaced it
    c3 = three["choices"][0]["text"]
    assert [m["content"] for m in directory.messages("alpha", sid)] == [first, added, c2, " And?", c3]
    assert [m.messages for m in directory.marks("alpha", sid)] == [1, 2, 2]

    # another tenant sending the same text gets a session of its own; alpha's is untouched
    theirs = complete(service, first + added, key="key-beta")
    assert theirs["kvsnap"]["source"] == "new" and theirs["kvsnap"]["session_id"] != sid
    assert sid not in directory.match_text("beta", "-", first + added)
    assert directory.get("beta", theirs["kvsnap"]["session_id"]) is not None
    assert directory.get("alpha", sid).version == version
    assert text_digests("alpha", "-", first) != text_digests("beta", "-", first)
    # opting out, and strict history (a re-formatted answer is no extension): new sessions
    assert complete(service, first + added, session="none")["kvsnap"]["source"] == "new"
    assert complete(service, first + added, history="strict")["kvsnap"]["source"] == "new"
    assert directory.get("alpha", sid).version == version


def test_a_text_prefix_keeps_the_newest_few_sessions_and_is_tenant_scoped(service):
    directory = SessionDirectory(service.redis_url)
    text = "y" * 200
    log = [{"role": "prompt", "content": text}, {"role": "completion", "content": "z"}]
    for n in range(6):
        directory.register_conversation("alpha", "-", f"s{n}", log)
    assert directory.match_text("alpha", "-", text + "z more") == ["s5", "s4", "s3", "s2"]  # newest first
    assert directory.match_text("alpha", "-", "y" * 63) == []  # shorter than one block: never matched
    assert directory.match_text("beta", "-", text + "z more") == []
    assert directory.match_text("alpha", "u:ann", text + "z more") == []
