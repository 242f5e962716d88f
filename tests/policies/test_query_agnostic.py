"""Query-agnostic compression (issue: a document compressed before any question is known):
KVzip+ scores from a scratch reconstruction pass, and KVzap surrogates trained here.

The oracle is checked against the formula computed from an eager forward pass's attention
weights; the scratch pass must leave the session exactly as it was; a surrogate retrained on
the tiny model in seconds must beat a constant predictor on held-out text; and the policies
keep exactly the rows their scores rank first."""

from __future__ import annotations

import pytest
import requests
import torch

from kvsnap.engine import SamplingParams
from kvsnap.errors import InvalidArgument
from kvsnap.policies import FullKV, make_policy, policy_from_json, policy_to_json
from kvsnap.policies.kvzip import REPEAT_PROMPT
from kvsnap.tools.kvzap_train import collect, corpus, pairs, train

from ..conftest import random_tokens


def _prefilled(engine, tokens, policy=None):
    session = engine.new_session(policy or FullKV())
    engine.prefill(session, tokens)
    return session


def _reference_scores(engine, context: list[int]) -> dict[int, torch.Tensor]:
    """KVzip+ log scores from one eager forward over context + repeat prompt + context, with
    the attention weights transformers returns and the attention inputs seen by hooks."""
    model, n = engine.model, len(context)
    repeat = engine.encode(REPEAT_PROMPT, first=False)
    ids = torch.tensor([context + repeat + context])
    inputs, handles = {}, []
    for idx, module in engine.attention.items():
        handles.append(
            module.register_forward_pre_hook(
                lambda m, a, kw, idx=idx: inputs.__setitem__(idx, kw["hidden_states"][0]), with_kwargs=True
            )
        )
    implementation = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(input_ids=ids, output_attentions=True, use_cache=True)
    finally:
        model.set_attn_implementation(implementation)
        for h in handles:
            h.remove()
    text = model.config.get_text_config()
    heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
    scores = {}
    for idx, module in engine.attention.items():
        attn = out.attentions[idx][0]  # [H, T, T]
        rows = slice(n + len(repeat), 2 * n + len(repeat))
        a = attn[:, rows, :n] / inputs[idx][rows].norm(dim=-1)[None, :, None]  # [H, n_j, n_i]
        values = out.past_key_values.layers[idx].values[0, :, :n]  # [H_kv, n, D]
        v = values.repeat_interleave(heads // kv_heads, dim=0)
        w_o = module.o_proj.weight.t().reshape(heads, v.shape[-1], -1)
        out_norm = torch.stack([(v[h] @ w_o[h]).norm(dim=-1) for h in range(heads)])  # [H, n]
        per_head = a.amax(dim=1) * out_norm
        scores[idx] = per_head.view(kv_heads, heads // kv_heads, n).amax(dim=1).log()
    return scores


def test_kvzip_scores_are_the_formula_on_an_eager_forward_and_leave_the_session_as_it_was(llama_engine):
    engine = llama_engine
    context = random_tokens(70, seed=3)
    session = _prefilled(engine, context)
    before = [t.clone() for layer in session.cache.layers for t in (layer.keys, layer.values)]
    state = (session.logical_len, list(session.transcript), session.kept_len)
    got = engine._reconstruction_scores(session, context)
    want = _reference_scores(engine, context)
    assert set(got) == set(want) == set(engine.full_layers)
    for idx in want:
        assert got[idx].shape == (1, want[idx].shape[0], len(context))
        torch.testing.assert_close(got[idx][0], want[idx], rtol=1e-3, atol=1e-3)
    after = [t for layer in session.cache.layers for t in (layer.keys, layer.values)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert (session.logical_len, session.transcript, session.kept_len) == state


def test_kvzip_keeps_the_rows_its_scores_rank_first_and_later_turns_keep_them(llama_engine):
    engine = llama_engine
    context = random_tokens(80, seed=5)
    policy = make_policy("kvzip", budget=20, window=8)
    session = _prefilled(engine, context, policy)
    full = _prefilled(engine, context)
    scores = engine._reconstruction_scores(full, context)
    for idx in engine.full_layers:
        want = policy.keep_scored(scores[idx], len(context))
        assert want.shape[-1] == 28
        kept, rows = session.cache.layers[idx].keys, full.cache.layers[idx].keys
        torch.testing.assert_close(kept, torch.gather(rows, 2, want[..., None].expand(-1, -1, -1, rows.shape[-1])))
    # a question later: the rows kept stay, the question's rows are scored among themselves
    answer = engine.turn(session, random_tokens(30, seed=6), SamplingParams(max_new_tokens=3))
    assert len(answer.tokens) == 3 and session.kept_len == 28 + 20 + 8 + 2  # old rows, best 20, window, answer fed
    with pytest.raises(InvalidArgument, match="reselect"):
        engine.new_session(policy, "reselect")
    assert policy_from_json(policy_to_json(policy)) == policy
    threshold = make_policy("kvzip", tau=float(scores[engine.full_layers[0]].median()), window=8)
    assert 8 < _prefilled(engine, context, threshold).kept_len < 80  # about half, as the text decides


@pytest.fixture(scope="module")
def tiny_surrogates(llama_engine):
    """Surrogates retrained on tiny-llama from a few short texts (seconds), and their R²."""
    texts = corpus(llama_engine.tokenizer, 12, 96)
    train_set = collect(llama_engine, texts[:9], per_text=64)
    test_set = collect(llama_engine, texts[9:], per_text=64, seed=1)
    return train(llama_engine, train_set, test_set, epochs=150)


def test_a_retrained_surrogate_beats_a_constant_predictor_on_held_out_text(tiny_surrogates):
    nets, report = tiny_surrogates
    for layer, value in report["linear"].items():
        assert value > report["constant"][layer] + 0.05, report
    assert max(report["mlp"].values()) > 0.05, report
    assert all(v <= 0.0 + 1e-6 for v in report["constant"].values())  # a constant explains nothing held out


def test_kvzap_keeps_the_rows_its_surrogate_ranks_first(llama_engine, tiny_surrogates):
    engine = llama_engine
    nets, _ = tiny_surrogates
    with pytest.raises(InvalidArgument, match="train_kvzap.py"):  # none shipped for tiny-llama
        engine.check(engine.new_session(make_policy("kvzap")), [1, 2, 3], None)
    engine.surrogates["linear"] = nets["linear"]
    try:
        context = random_tokens(90, seed=8)
        policy = make_policy("kvzap", budget=24, window=8)
        session = _prefilled(engine, context, policy)
        x, _ = pairs(engine, context)  # the attention inputs of the same rows, from a separate prefill
        full = _prefilled(engine, context)
        for idx in engine.full_layers:
            with torch.no_grad():
                predicted = nets["linear"](idx, x[idx])[None]  # [1, H_kv, n]
            want = policy.keep_scored(predicted, len(context))
            rows = full.cache.layers[idx].keys
            got = session.cache.layers[idx].keys
            torch.testing.assert_close(got, torch.gather(rows, 2, want[..., None].expand(-1, -1, -1, rows.shape[-1])))
        tau = float(predicted.median())
        kept = _prefilled(engine, context, make_policy("kvzap", tau=tau, window=8)).kept_len
        assert 8 < kept < 90
    finally:
        engine.surrogates.pop("linear", None)


def test_the_service_opens_kvzip_sessions_and_refuses_kvzap_without_weights(service):
    doc = "The harbour master logs every ship. The code word is amber falcon. " * 4
    r = requests.post(
        f"{service.http}/v1/sessions",
        headers=service.headers(),
        json={"document": doc, "settings": {"policy": "kvzip", "budget": 32, "window": 16}},
    )
    assert r.status_code == 201, r.text
    state = r.json()
    assert state["kept_len"] == 48 < state["logical_len"] and state["policy"].startswith("kvzip(")
    refused = requests.post(
        f"{service.http}/v1/sessions",
        headers=service.headers(),
        json={"document": doc, "settings": {"policy": "kvzap", "surrogate": "mlp"}},
    )
    assert refused.status_code == 400 and "train_kvzap.py" in refused.json()["error"]["message"]


def test_grpc_opens_kvzip_sessions_with_their_params_and_refuses_kvzap_without_weights(service):
    """The same over gRPC: kvzip's budget and window in the settings' fields, its other
    parameters in ``params`` (coerced by type); a follow-up turn keeps the session's policy."""
    import grpc

    from kvsnap.service.grpc_stubs import pb2, pb2_grpc

    stub = pb2_grpc.KvsnapStub(grpc.insecure_channel(service.grpc))
    md = [("authorization", "Bearer key-alpha")]
    doc = "The harbour master logs every ship. The code word is amber falcon. " * 4
    settings = pb2.SessionSettings(policy="kvzip", budget=32, window=16)
    state = stub.CreateSession(
        pb2.CreateSessionRequest(session_id="zip-grpc", document=doc, settings=settings), metadata=md
    )
    assert state.policy.startswith("kvzip(") and state.kept_len == 48 < state.logical_len  # before any question
    chunks = list(stub.Turn(pb2.TurnRequest(session_id="zip-grpc", message="What is the code word?"), metadata=md))
    done = chunks[-1]
    assert done.done and done.state.policy == state.policy and done.state.turns == state.turns + 1
    threshold = pb2.SessionSettings(policy="kvzip", params={"tau": "-30.5"})
    state = stub.CreateSession(pb2.CreateSessionRequest(document=doc, settings=threshold), metadata=md)
    assert "tau=-30.5" in state.policy  # a parameter with no field of its own, parsed as its type
    with pytest.raises(grpc.RpcError) as refused:
        stub.CreateSession(
            pb2.CreateSessionRequest(
                document=doc, settings=pb2.SessionSettings(policy="kvzap", params={"surrogate": "mlp"})
            ),
            metadata=md,
        )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "train_kvzap.py" in refused.value.details()
    with pytest.raises(grpc.RpcError) as bad:
        stub.CreateSession(
            pb2.CreateSessionRequest(document=doc, settings=pb2.SessionSettings(policy="kvzip", params={"tau": "x"})),
            metadata=md,
        )
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tau" in bad.value.details()


def test_kvzap_with_a_threshold_prunes_the_answer_too_and_a_rebuild_replays_it(llama_engine, tiny_surrogates):
    """Phase-agnostic: with ``tau`` the answer's rows are scored as they are generated and
    pruned a window at a time once older than the recent window; a rebuild from the token log
    feeds the answer back the same way and ends with the same KV."""
    engine = llama_engine
    nets, _ = tiny_surrogates
    engine.surrogates["linear"] = nets["linear"]
    try:
        context = random_tokens(60, seed=9)
        x, _ = pairs(engine, context)
        idx = engine.full_layers[0]
        with torch.no_grad():
            tau = float(nets["linear"](idx, x[idx]).median())
        policy = make_policy("kvzap", tau=tau, window=8)
        prefilled = _prefilled(engine, context, policy).kept_len
        session = engine.new_session(policy)
        engine.turn(session, context, SamplingParams(max_new_tokens=40, ignore_eos=True))
        assert engine.prunes_answers(policy) and not engine.prunes_answers(make_policy("kvzap"))
        fed = session.logical_len - len(context)  # 39 rows the answer added
        assert prefilled + 8 <= session.kept_len < prefilled + fed
        rebuilt = engine.new_session(policy)
        engine.rebuild(rebuilt, session.transcript, session.logical_len, session.marks)
        for a, b in zip(session.cache.layers, rebuilt.cache.layers, strict=True):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    finally:
        engine.surrogates.pop("linear", None)


def test_surrogates_must_be_trained_on_the_model_and_kvzip_turns_fit_twice(llama_engine, tiny_surrogates, tmp_path):
    nets, _ = tiny_surrogates
    path = tmp_path / "tiny.linear.safetensors"
    nets["linear"].save(path, {"fingerprint": "another-model"})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("kvsnap.engine.compress.weights_path", lambda model, kind: path)
        with pytest.raises(InvalidArgument, match="trained on another model"):
            llama_engine.surrogate("linear")
        nets["linear"].save(path, {"fingerprint": llama_engine.loaded.weights})
        assert llama_engine.surrogate("linear") is not None
    llama_engine.surrogates.pop("linear")
    half = llama_engine.max_context // 2
    session = llama_engine.new_session(make_policy("kvzip"))
    with pytest.raises(InvalidArgument, match="scratch pass"):
        llama_engine.check(session, random_tokens(half + 1, seed=1), None)
    llama_engine.check(session, random_tokens(half - 20, seed=1), None)


def test_engines_sharing_a_model_hook_its_attention_once(llama_engine):
    from kvsnap.engine import Engine

    again = Engine(llama_engine.loaded, prefill_chunk=16)  # the same model object
    module = again.attention[again.full_layers[0]]
    assert len(module._forward_pre_hooks) == 1
    x, _ = pairs(again, random_tokens(20, seed=2))
    assert all(v.shape[0] == 20 for v in x.values())
