"""The quality harness (`kvsnap eval`): its tasks, its scoring, its two backends, its outputs."""

from __future__ import annotations

import json
import math

import pytest

from kvsnap.engine import Engine, load_model
from kvsnap.engine.models import ByteTokenizer
from kvsnap.errors import InvalidArgument
from kvsnap.tools import quality
from kvsnap.tools.cli import main as kvsnap
from kvsnap.tools.facts import FACT_KINDS, facts_document
from kvsnap.tools.tasks import multi_key_prompt

TINY = dict(lengths=(300,), depths=(0.3,), keys=2, seeds=1, window=8, policies=("full", "snapkv:64", "streaming:64"))


def test_multi_key_prompt_plants_every_key_in_depth_order():
    tok = ByteTokenizer()
    p = multi_key_prompt(tok, target_tokens=2000, keys=4, seed=7)
    assert len(set(p.names)) == 4 and len(set(p.answers)) == 4
    positions = [p.document.index(f"magic number for {n} is {v}") for n, v in zip(p.names, p.answers, strict=True)]
    assert positions == sorted(positions)  # key i lies in the i-th slice of the document
    for pos, depth in zip(positions, p.depths, strict=True):
        assert abs(pos / len(p.document) - depth) < 0.1
    assert 1800 <= len(tok.encode(p.document + p.question(0))) <= 2000


def test_cases_cover_every_task_length_depth_and_key():
    spec = quality.EvalSpec(lengths=(400, 800), depths=(0.2, 0.8), keys=3, seeds=2)
    cases = quality.build_cases(ByteTokenizer(), spec)
    count = {t: sum(c.task == t for c in cases) for t in quality.RETRIEVAL_TASKS}
    assert count == {"passkey": 2 * 2 * 2, "multikey": 2 * 2 * 3, "multiturn": 2 * 2}
    for c in cases:
        assert all(a in c.turns[0] for a in c.answers)  # the document (turn 1) holds every asked key
        assert len(c.turns) == len(c.answers) == len(c.depths)
    multiturn = [c for c in cases if c.task == "multiturn"]
    assert all(len(c.turns) == 3 and len(set(c.answers)) == 3 for c in multiturn)  # each turn asks another key
    assert len({c.answers[0] for c in multiturn if c.length == 400}) == 2  # seeds ask a different key first


def test_bad_specs_are_rejected():
    for bad in (dict(tasks=("nope",)), dict(lengths=()), dict(depths=(1.5,)), dict(keys=1), dict(policies=("h2o",))):
        with pytest.raises(InvalidArgument):
            quality.EvalSpec(**bad)
    for text in ("snapkv", "snapkv:0", "full:3", "streaming:x", "snapkv:8+snapkv:4", "h2o:8@kivi3", "full@kivi"):
        with pytest.raises(InvalidArgument):
            quality.PolicySpec.parse(text)
    with pytest.raises(InvalidArgument, match="in-process only"):
        spec = quality.EvalSpec(**TINY | {"tasks": ("longgen",)})
        quality.evaluate(object(), quality.build_cases(ByteTokenizer(), spec), spec)


def test_policy_specs_hold_like_for_like_rows():
    """Every compressing spec keeps B + window rows after prefill; decoders cap at D + window."""
    window = 8
    for text in ("snapkv:64", "h2o:64", "scissorhands:64", "streaming:64", "reselect:64"):
        policy, recompress, kivi = quality.PolicySpec.parse(text).build(window)
        assert policy.prefix_budget(10_000) + policy.window == 64 + window, text
        assert kivi is None and recompress == ("reselect" if text.startswith("reselect") else "per_turn")
    for text in ("snapkv:64+h2o:16", "full+scissorhands:16", "h2o:64+streaming:16@kivi4"):
        policy, _, kivi = quality.PolicySpec.parse(text).build(window)
        assert policy.decoder().capacity() == 16 + window, text
    assert kivi.bits == 4
    assert quality.PolicySpec.parse("snapkv:64+h2o:16").settings(window)["decode"] == {
        "policy": "h2o",
        "budget": 16,
        "window": window,
    }


def test_long_generation_scores_each_policy_against_full_kv(llama_engine):
    policies = ("full", "snapkv:32", "snapkv:32+h2o:8", "scissorhands:32", "snapkv:32@kivi2")
    spec = quality.EvalSpec(**TINY | {"tasks": ("longgen",), "gen_tokens": 48, "policies": policies})
    cases = quality.build_cases(llama_engine.tokenizer, spec)
    rows = {s.policy: s for s in quality.evaluate(quality.InProcess(llama_engine), cases, spec)}
    full = rows["full"]
    assert full.agreement == 1.0 and full.tokens > 0  # full KV reads its own greedy tokens back
    assert rows["snapkv:32+h2o:8"].kept_len_max <= 8 + 8 < rows["snapkv:32"].kept_len_max
    assert rows["scissorhands:32"].kept_len_max <= 32 + 8
    assert rows["snapkv:32@kivi2"].kv_bytes < rows["snapkv:32"].kv_bytes < full.kv_bytes
    assert all(0 <= r.agreement <= 1 and r.nll > 0 and r.decode_tok_s > 0 for r in rows.values())
    summary = quality.summarize(list(rows.values()))
    assert summary["longgen"]["full"]["perplexity"] == pytest.approx(math.exp(full.nll))
    table = quality.format_tables(summary)
    assert "longgen" in table and "snapkv:32+h2o:8" in table


def test_in_process_eval_scores_what_the_model_answered(llama_engine, tmp_path):
    spec = quality.EvalSpec(**TINY)
    cases = quality.build_cases(llama_engine.tokenizer, spec)
    scores = quality.evaluate(quality.InProcess(llama_engine), cases, spec)
    assert len(scores) == 3 * sum(len(c.turns) for c in cases)
    for s in scores:
        assert s.correct == (s.answer in s.text) and s.latency_s > 0 and s.kv_bytes > 0
        assert s.kv_bytes <= s.full_kv_bytes
    summary = quality.summarize(scores)
    assert set(summary) == set(quality.RETRIEVAL_TASKS) and all(set(v) == set(spec.policies) for v in summary.values())
    kv = {p: summary["multiturn"][p]["kv_bytes_mean"] for p in spec.policies}
    assert kv["snapkv:64"] < kv["full"] and kv["streaming:64"] < kv["full"]
    assert list(summary["multiturn"]["full"]["per_turn"]) == ["1", "2"]
    assert summary["multiturn"]["full"]["follow_up_accuracy"] == summary["multiturn"]["full"]["per_turn"]["2"]
    assert summary["passkey"]["full"]["follow_up_accuracy"] is None

    paths = quality.save(scores, summary, {"model": "tiny-llama"}, tmp_path)
    saved = json.loads(paths["json"].read_text())
    assert saved["summary"] == json.loads(json.dumps(summary)) and len(saved["turns"]) == len(scores)
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = quality.format_tables(summary)
    assert "multiturn" in table and "snapkv:64" in table and "turn 2" in table


def test_service_backend_answers_like_the_engine(service):
    """Through /v1/completions with x-session-id the service answers what the engine answers."""
    policies = ("full", "snapkv:64", "reselect:64/s", "snapkv:64+h2o:8")
    spec = quality.EvalSpec(**TINY | {"policies": policies, "tasks": (*quality.RETRIEVAL_TASKS, "facts")})
    engine = Engine(load_model("tiny-llama"))  # the replicas' prefill chunking
    cases = quality.build_cases(engine.tokenizer, spec)
    local = quality.evaluate(quality.InProcess(engine), cases, spec)
    remote = quality.evaluate(quality.OverHTTP(service.http, "key-alpha"), cases, spec)
    assert [(s.policy, s.turn, s.text) for s in remote] == [(s.policy, s.turn, s.text) for s in local]
    assert {s.task for s in remote} == {*quality.RETRIEVAL_TASKS, "facts"}  # chat turns too
    assert [s.context_tokens for s in remote] == [s.context_tokens for s in local]
    assert [s.kv_bytes for s in remote] == [s.kv_bytes for s in local]
    with pytest.raises(InvalidArgument, match="per deployment"):
        quality.OverHTTP(service.http, "key-alpha").run(cases[0], quality.PolicySpec.parse("full@kivi2"), 8)


def test_kvsnap_eval_cli_writes_results(tmp_path, capsys):
    argv = ["eval", "--model", "tiny-llama", "--lengths", "200", "--depths", "0.5", "--keys", "2", "--seeds", "1"]
    argv += ["--policies", "full,snapkv:32", "--window", "8", "--tasks", "passkey,multiturn", "--out", str(tmp_path)]
    assert kvsnap(argv + ["--json"]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    assert set(summary) == {"passkey", "multiturn"} and set(summary["passkey"]) == {"full", "snapkv:32"}
    assert (tmp_path / "quality.json").exists() and (tmp_path / "quality.png").exists()
    assert kvsnap(["eval", "--model", "tiny-llama", "--policies", "bogus", "--out", str(tmp_path)]) == 2


def test_kvsnap_eval_against_the_service(service, tmp_path, capsys):
    argv = ["eval", "--url", service.http, "--api-key", "key-beta", "--lengths", "200", "--depths", "0.5"]
    argv += ["--keys", "2", "--seeds", "1", "--policies", "full,reselect:32", "--window", "8", "--out", str(tmp_path)]
    assert kvsnap(argv) == 0
    saved = json.loads((tmp_path / "quality.json").read_text())
    assert saved["meta"]["model"] == "tiny-llama"  # asked of the service, for its tokenizer
    assert saved["meta"]["backend"] == f"service {service.http}"
    assert {t["policy"] for t in saved["turns"]} == {"full", "reselect:32"}
    assert "multiturn" in capsys.readouterr().out


def test_document_first_cases_compress_before_the_questions(llama_engine):
    """``docfirst``: the document alone first (nothing generated), then one question per key;
    ratio and threshold specs; kvzip at a share of the prefix holds what snapkv holds."""
    spec = quality.EvalSpec(**TINY | {"tasks": ("docfirst",), "policies": ("full", "snapkv:r0.3", "kvzip:r0.3")})
    cases = quality.build_cases(llama_engine.tokenizer, spec)
    assert [c.task for c in cases] == ["docfirst"] and cases[0].opening
    assert all(a in cases[0].opening and a not in "".join(cases[0].turns) for a in cases[0].answers)
    scores = quality.evaluate(quality.InProcess(llama_engine), cases, spec)
    assert len(scores) == 3 * len(cases[0].turns)
    first = {s.policy: s for s in scores if s.turn == 1}
    # after the first question: the document's 30 % each, and the question's rows (kvzip keeps
    # them all; snapkv recompresses everything to 30 % of what it has seen)
    kvzip, snapkv = first["kvzip:r0.3"].kv_bytes, first["snapkv:r0.3"].kv_bytes
    assert abs(kvzip - snapkv) < 0.05 * snapkv and max(kvzip, snapkv) < 0.5 * first["full"].kv_bytes
    want = {"policy": "kvzap", "window": 8, "tau": -4.5, "spans": False}  # spans spelled out: a service may differ
    assert quality.PolicySpec.parse("kvzap:t-4.5").settings(8) == want
    unpooled, _, _ = quality.PolicySpec.parse("kvzip:r0.3/k1").build(8)  # the pooling kernel, spelled out
    assert unpooled.pool() == 1 and quality.PolicySpec.parse("kvzip:r0.3").build(8)[0].pool() == 15
    with pytest.raises(InvalidArgument, match="kernel"):
        quality.PolicySpec.parse("streaming:64/k3").build(8)
    with pytest.raises(InvalidArgument, match="kvzip and kvzap only"):
        quality.PolicySpec.parse("snapkv:t-4")
    with pytest.raises(InvalidArgument, match="in-process only"):
        quality.OverHTTP.run(object.__new__(quality.OverHTTP), cases[0], spec.specs[0], 8)


def test_facts_documents_state_each_fact_once_in_varied_prose():
    tok = ByteTokenizer()
    doc = facts_document(tok, target_tokens=3000, facts=6, seed=3)
    text = doc.document
    assert {f.kind for f in doc.facts} == set(FACT_KINDS) and list(doc.depths) == sorted(doc.depths)
    for fact, depth in zip(doc.facts, doc.depths, strict=True):
        assert text.count(fact.answer) == 1 and text.count(fact.sentence) == 1  # stated once
        assert abs(text.index(fact.sentence) / len(text) - depth) < 0.1
        assert fact.answer not in fact.question
    filler = text
    for fact in doc.facts:
        filler = filler.replace(fact.sentence, "")
    assert not any(c.isdigit() for c in filler)  # nothing in the prose looks like an answer
    sentences = [s for s in filler.replace("\n", " ").split(". ") if s.strip()]
    assert len(set(sentences)) > 0.8 * len(sentences)  # varied, not one repeated sentence
    assert 2900 <= len(tok.encode(text)) <= 3100


def test_facts_cases_ask_one_fact_per_turn_over_the_chat_template(llama_engine):
    spec = quality.EvalSpec(**TINY | {"tasks": ("facts",), "lengths": (600,), "keys": 3, "policies": ("full",)})
    (case,) = quality.build_cases(llama_engine.tokenizer, spec)
    assert case.chat and len(case.turns) == 3 and len(set(case.answers)) == 3
    assert all(a in case.turns[0] for a in case.answers)  # the document comes with the first question
    assert not any(a in t for a in case.answers for t in case.turns[1:])
    scores = quality.evaluate(quality.InProcess(llama_engine), [case], spec)
    assert [s.turn for s in scores] == [1, 2, 3] and all(s.kv_bytes == s.full_kv_bytes for s in scores)
    session = llama_engine.new_session("full")
    backend = quality.InProcess(llama_engine)
    first = backend._tokens(case, 0, case.turns[0], session)  # the plain template (no chat template)
    assert llama_engine.decode(first).endswith(f"User: {case.turns[0]}\nAssistant:")
