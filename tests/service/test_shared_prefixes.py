"""Shared prompt prefixes through the real service: plain OpenAI chats on one document (no session
header) start from the rows the first chat prefilled, on the replica that holds them, answer as a
chat that prefilled everything, and never reach another tenant's rows; /metrics shows them."""

from __future__ import annotations

import time
import uuid

import openai
import requests

# ~1,400 tokens (tiny-llama's tokenizer is bytes): one whole prefill chunk (1,024) and more
DOCUMENT = " ".join(f"Crate {i} weighs {i * 7 % 101} kg." for i in range(60))
QUESTIONS = ["Which crate weighs 14 kg?", "How much does crate 9 weigh?"]


def chat(service, key: str, doc: str, question: str):
    client = openai.OpenAI(base_url=f"{service.http}/v1", api_key=key)
    messages = [{"role": "system", "content": doc}, {"role": "user", "content": question}]
    return client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=6, temperature=0)


def metric_values(service, name: str, key: str = "key-alpha") -> dict[str, float]:
    text = requests.get(f"{service.http}/metrics", headers=service.headers(key), timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith(name):
            labels, value = line.rsplit(" ", 1)
            out[labels] = float(value)
    return out


def test_chats_on_one_document_start_from_the_first_ones_rows(service):
    doc = f"Manifest {uuid.uuid4().hex}. {DOCUMENT}"  # no earlier test sent its first chunk
    first = chat(service, "key-alpha", doc, QUESTIONS[0])
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    later = chat(service, "key-alpha", doc, QUESTIONS[1])
    assert later.usage.prompt_tokens_details.cached_tokens == 1024  # the document's first chunk, not prefilled
    assert later.model_extra["kvsnap"]["worker"] == first.model_extra["kvsnap"]["worker"]  # routed to its holder
    assert later.model_extra["kvsnap"]["session_id"] != first.model_extra["kvsnap"]["session_id"]
    # another tenant sends the very same chat: nothing of alpha's serves it, and its answer,
    # computed from the whole prompt, is the one alpha's chat got from the shared rows
    alone = chat(service, "key-beta", doc, QUESTIONS[1])
    assert alone.usage.prompt_tokens_details.cached_tokens == 0
    assert alone.usage.prompt_tokens == later.usage.prompt_tokens
    assert alone.choices[0].message.content == later.choices[0].message.content


def test_metrics_show_shared_prefixes_and_a_tenant_only_its_own(service):
    doc = f"Ledger {uuid.uuid4().hex}. {DOCUMENT}"
    for q in QUESTIONS:
        chat(service, "key-alpha", doc, q)
    deadline = time.monotonic() + 60  # workers publish their numbers with their heartbeat (2 s)
    while time.monotonic() < deadline:
        own = metric_values(service, "kvsnap_prefix_tenant_bytes{")
        hits = metric_values(service, "kvsnap_prefix_hits_total{")
        if sum(own.values()) > 0 and sum(hits.values()) >= 1:
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"no shared prefix in /metrics: {own} {hits}")
    assert all('tenant="alpha"' in k for k in own)
    assert sum(metric_values(service, "kvsnap_prefix_bytes{").values()) >= sum(own.values())
    assert sum(metric_values(service, "kvsnap_prefix_tokens_reused_total{").values()) >= 1024
    assert sum(metric_values(service, "kvsnap_cached_prompt_tokens_total").values()) >= 1024
    # another tenant's scrape: its own series (none held), never alpha's
    theirs = metric_values(service, "kvsnap_prefix_tenant_bytes{", key="key-beta")
    assert theirs and all('tenant="beta"' in k for k in theirs)
