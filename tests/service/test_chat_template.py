"""A model's own chat template (the embedded SmolLM2-135M-Instruct's ChatML), used append-only:
a session's tokens, built one turn at a time, are those the template gives for the whole
conversation, and the model answers in kvsnap's engine as it does in transformers' own."""

from __future__ import annotations

import time

import pytest
import requests
import torch

from kvsnap.errors import InvalidArgument
from kvsnap.service.template import ChatTemplate, PlainTemplate, encode_messages, template_for

DOC = "Notes. The pass key is 48213. Foxes live in dens and hunt at dusk."
CONVERSATION = [
    {"role": "document", "content": DOC},
    {"role": "user", "content": "What is the pass key?"},
    {"role": "assistant", "content": "The pass key is 48213."},
    {"role": "user", "content": "Where do foxes live?"},
    {"role": "assistant", "content": " In dens.\nThey hunt at dusk."},  # a leading space, a newline
    {"role": "user", "content": "Thanks!"},
]


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from kvsnap.engine.models import tokenizer_for

    return tokenizer_for("smollm2-135m")  # converted once into ~/.cache/kvsnap (about 20 s), then seconds


def whole(tokenizer, messages: list[dict], gen: bool = True) -> list[int]:
    """The template's tokens for the whole conversation (a document renders as a system message)."""
    mapped = [m | {"role": "system"} if m["role"] == "document" else m for m in messages]
    ids = tokenizer.apply_chat_template(mapped, tokenize=True, add_generation_prompt=gen)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_turn_by_turn_tokens_are_the_whole_conversations(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert isinstance(template_for(tok), ChatTemplate) and template_for(tok).close == "<|im_end|>\n"
    # a session opened with its document alone (POST /v1/sessions), then three turns
    held = encode_messages(tok, CONVERSATION[:1], first=True)
    for i in (1, 3, 5):
        held += encode_messages(tok, CONVERSATION[i : i + 1], first=False)
        assert held == whole(tok, CONVERSATION[: i + 1]), i
        if i < 5:  # the answer as generated: its tokens, EOS not kept
            held += tok.encode(CONVERSATION[i + 1]["content"], add_special_tokens=False)
    # a chat opened with history (OpenAI: earlier messages in the first request), then one turn
    first = encode_messages(tok, CONVERSATION[:4], first=True)
    assert first == whole(tok, CONVERSATION[:4])
    rest = tok.encode(CONVERSATION[4]["content"], add_special_tokens=False)
    assert first + rest + encode_messages(tok, CONVERSATION[5:], first=False) == whole(tok, CONVERSATION)
    # without a system message the template adds its default one, once, at the start
    chat = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    built = encode_messages(tok, chat[:1], True) + tok.encode("Hello!", add_special_tokens=False)
    assert built + encode_messages(tok, chat[2:], False) == whole(tok, chat)
    assert "SmolLM" in tok.decode(built)


def test_models_without_a_chat_template_get_the_plain_one():
    from kvsnap.engine.models import ByteTokenizer

    assert isinstance(template_for(ByteTokenizer()), PlainTemplate)
    with pytest.raises(InvalidArgument, match="role must be one of"):
        encode_messages(ByteTokenizer(), [{"role": "tool", "content": "x"}], first=True)


class _LastTwoOnly:
    """A template that shows only the last two messages: it rewrites history, so a session
    cannot be resumed by appending (kvsnap refuses it, at the ingress's start)."""

    chat_template = "last two"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        text = "".join(f"<{m['role']}>{m['content']}</s>" for m in messages[-2:])
        return text + ("<assistant>" if add_generation_prompt else "")


def test_a_template_that_rewrites_history_is_refused():
    with pytest.raises(InvalidArgument, match="append-only"):
        ChatTemplate(_LastTwoOnly())
    assert isinstance(template_for(_LastTwoOnly()), PlainTemplate)  # the model still serves, on the plain one


class _NoSystemAfterUser(_LastTwoOnly):
    """Append-only, but refuses a system message after a user one (as some templates raise)."""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        roles = [m["role"] for m in messages]
        if "user" in roles and "system" in roles[roles.index("user") :]:
            raise ValueError("system messages must come first")
        text = "".join(f"<{m['role']}>{m['content']}</s>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


def test_messages_a_template_refuses_are_a_bad_request():
    template = template_for(_NoSystemAfterUser())
    assert isinstance(template, ChatTemplate)
    assert template.encode([{"role": "user", "content": "q"}], first=False)  # a follow-up renders
    with pytest.raises(InvalidArgument, match="refused these messages"):
        template.encode([{"role": "user", "content": "q"}, {"role": "document", "content": "d"}], first=True)


@pytest.mark.slow
def test_smollm2_answers_in_the_engine_as_in_transformers():
    """Two greedy turns in kvsnap's engine (full KV) equal transformers' generate over the whole
    conversation's template tokens, each turn. In float32, where the engine's operators are
    transformers' own: in bf16 its C kernels sum in other orders (cpu_kernels/decode_attention.py,
    cpu_kernels/chunk_attention.py), which moves a token at a near tie (turn 2 here: "Foxes are found
    in dens" against "Foxes live in dens")."""
    from kvsnap.engine import Engine, SamplingParams, load_model

    engine = Engine(load_model("smollm2-135m", dtype="float32"), prefill_chunk=512)
    tok, model = engine.tokenizer, engine.model
    assert model.config.model_type == "llama" and model.config.num_key_value_heads == 3
    assert engine.eos_ids == {tok.convert_tokens_to_ids("<|im_end|>")}
    session = engine.new_session("full")
    messages = [{"role": "document", "content": DOC}, {"role": "user", "content": "What is the pass key?"}]
    sampling = SamplingParams(max_new_tokens=12)
    context: list[int] = []
    for turn, question in enumerate([None, "And where do foxes live?"]):
        new = messages if turn == 0 else [{"role": "user", "content": question}]
        tokens = encode_messages(tok, new, first=turn == 0)
        result = engine.turn(session, tokens, sampling)
        context += tokens
        with torch.no_grad():
            want = model.generate(torch.tensor([context]), max_new_tokens=12, do_sample=False)[0, len(context) :]
        want = want.tolist()
        want = want[: next((i for i, t in enumerate(want) if t in engine.eos_ids), len(want))]  # EOS not kept
        assert result.tokens == want, (turn, result.text, tok.decode(want))
        assert result.tokens, "an empty answer proves nothing"
        context += result.tokens
    assert "48213" in tok.decode(context)


@pytest.mark.slow
def test_a_chat_on_smollm2_through_the_service_prefills_only_each_new_message(service, tmp_path):
    """The OpenAI chat route on a Serve app of the embedded SmolLM2 (`kvsnap serve --model
    smollm2-135m`): its chat template, no plain-template stop string (EOS ends an answer), each
    follow-up prefills only its new message, answers equal the engine's turn by turn."""
    import requests
    from ray import serve

    from kvsnap.engine import Engine, SamplingParams, load_model
    from kvsnap.ports import free_port
    from kvsnap.service.app import build_app
    from kvsnap.service.config import ServiceConfig

    cfg = service.cfg.model_copy(
        update=dict(
            model="smollm2-135m",
            replicas=1,
            cpus_per_replica=0.01,
            grpc_port=free_port(),
            api_keys={"smol-key": "smol"},
            data_dir=str(tmp_path),
        )
    )
    serve.run(build_app(ServiceConfig(**cfg.model_dump()), service.redis_url), name="smollm2", route_prefix="/smollm2")
    try:
        engine = Engine(load_model("smollm2-135m"), prefill_chunk=cfg.prefill_chunk)
        reference = engine.new_session("full")
        url = f"{service.http}/smollm2/v1/chat/completions"
        headers = {"Authorization": "Bearer smol-key", "x-session-id": "smol-1"}
        messages = [{"role": "system", "content": DOC}]
        for i, question in enumerate(["What is the pass key?", "Where do foxes live?"]):
            messages.append({"role": "user", "content": question})
            new = messages[-1:] if i else messages  # what this turn adds to the session
            body = {"model": "smollm2-135m", "messages": messages, "max_tokens": 16, "kvsnap": {"policy": "full"}}
            r = requests.post(url, headers=headers, json=body, timeout=120)
            assert r.status_code == 200, r.text
            got = r.json()
            tokens = encode_messages(engine.tokenizer, new, first=i == 0)
            want = engine.turn(reference, tokens, SamplingParams(max_new_tokens=16))
            assert got["choices"][0]["message"]["content"] == want.text, (i, got, want.text)
            # a follow-up prefills its new message and the previous answer's last token, nothing more
            assert got["usage"]["prompt_tokens"] == len(tokens) + (i > 0), (i, got["usage"], len(tokens))
            messages.append({"role": "assistant", "content": got["choices"][0]["message"]["content"]})
    finally:
        serve.delete("smollm2")
        _until_its_workers_are_gone(service)


def _until_its_workers_are_gone(service, timeout_s: float = 60) -> None:
    """The deleted app's replica stops heartbeating; its load entry on the shared Redis expires
    within the heartbeat TTL. Later tests read /health of the shared service: wait for it."""
    deadline = time.monotonic() + timeout_s
    while requests.get(f"{service.http}/health", timeout=10).json()["dtype"] != ["float32"]:
        assert time.monotonic() < deadline, "the smollm2 app's workers still listed in /health"
        time.sleep(0.5)
