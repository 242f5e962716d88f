"""The OpenAI routes end to end, through the real ``openai`` client: chat completions (streamed
and not) and completions on a session named by ``x-session-id`` equal the in-process engine and
prefill only what is new."""

from __future__ import annotations

import openai

from kvsnap.engine import SamplingParams
from kvsnap.service.template import encode_messages

from .helpers import DOC, FULL, QUESTIONS


def test_three_turns_through_the_openai_client_equal_the_engine(service, llama_engine):
    client = openai.OpenAI(base_url=f"{service.http}/v1", api_key="key-alpha")
    assert [m.id for m in client.models.list()] == ["tiny-llama"]
    tok = llama_engine.tokenizer
    reference = llama_engine.new_session("full")
    messages = [{"role": "system", "content": DOC}]
    for i, q in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": q})
        new = messages if i == 0 else messages[-1:]
        want = llama_engine.turn(reference, encode_messages(tok, new, i == 0), SamplingParams(max_new_tokens=6)).text
        kwargs = dict(
            model="tiny-llama",
            messages=messages,
            max_tokens=6,
            extra_headers={"x-session-id": "oai-3"},
            extra_body={"kvsnap": FULL},
        )
        if i == 1:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            response = client.chat.completions.create(**kwargs)
            text = response.choices[0].message.content
            prefilled = response.usage.prompt_tokens
            assert prefilled == len(encode_messages(tok, new, i == 0)) + (i > 0)  # only what is new
        assert text == want
        messages.append({"role": "assistant", "content": text})

    completion = client.completions.create(
        model="tiny-llama",
        prompt=DOC,
        max_tokens=5,
        extra_headers={"x-session-id": "oai-raw"},
        extra_body={"kvsnap": FULL},
    )
    follow = client.completions.create(
        model="tiny-llama",
        prompt=DOC + completion.choices[0].text + " More.",
        max_tokens=5,
        extra_headers={"x-session-id": "oai-raw"},
    )
    assert follow.usage.prompt_tokens == len(tok.encode(" More.", add_special_tokens=False)) + 1
