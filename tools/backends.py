"""Where ``kvsnap eval`` runs a case: in-process on the engine (:class:`InProcess`), or against
a running service through ``/v1/completions`` with ``x-session-id`` (:class:`OverHTTP`). Both
answer with the same dicts, one per turn, that :func:`~.quality.evaluate` scores."""

from __future__ import annotations

import time
import uuid

from kvsnap.errors import InvalidArgument

from .specs import PolicySpec
from .tasks import Case

ANSWER_TOKENS = 8  # a 5-digit key and a little more
CHAT_ANSWER_TOKENS = 24  # a chat model often restates the question (12+ tokens) before the fact
LONGGEN_PROMPT = "\n\nA detailed account of everything in the text above, sentence by sentence:\n"


class InProcess:
    """Runs cases on an :class:`Engine` in this process."""

    def __init__(self, engine):
        self.engine = engine

    def run(self, case: Case, spec: PolicySpec, window: int) -> list[dict]:
        from kvsnap.engine import SamplingParams

        policy, recompress, kivi = spec.build(window)
        session = self.engine.new_session(policy, recompress=recompress)
        out = []
        if case.opening:  # the document alone first: compressed before any question is known
            self.engine.prefill(session, self.engine.encode(case.opening, first=True))
            if kivi:
                round_trip(self.engine, session, kivi)
        stop = self._template().stop if case.chat else ()
        sampling = SamplingParams(max_new_tokens=CHAT_ANSWER_TOKENS if case.chat else ANSWER_TOKENS, stop=stop)
        for i, text in enumerate(case.turns):
            t0 = time.perf_counter()
            result = self.engine.turn(session, self._tokens(case, i, text, session), sampling)
            r = result.report
            stored = round_trip(self.engine, session, kivi) if kivi else r.kv_bytes  # as the tier holds it
            out.append(
                {
                    "text": result.text,
                    "latency_s": time.perf_counter() - t0,
                    "context_tokens": r.logical_len,
                    "kv_bytes": stored,
                    "copy_bytes": session.full_copy_bytes,  # a re-selecting session's full copy (host tier)
                    "full_kv_bytes": r.full_kv_bytes,
                }
            )
        return out

    def _template(self):
        from kvsnap.service.template import template_for

        return template_for(self.engine.tokenizer)

    def _tokens(self, case: Case, i: int, text: str, session) -> list[int]:
        """Turn ``i``'s tokens: raw text, or one user message under the model's chat template, as
        the service tokenizes it (its turn marker skipped when the last answer stopped on it)."""
        if not case.chat:
            return self.engine.encode(text, first=i == 0 and not case.opening)
        template = self._template()
        ids = template.encode([{"role": "user", "content": text}], first=i == 0)
        n = len(template.marker)
        if n and i > 0 and ids[:n] == template.marker and session.transcript[-n:] == template.marker:
            ids = ids[n:]
        return ids

    def generate(self, case: Case, specs: list[PolicySpec], window: int, tokens: int) -> list[dict]:
        """Long generation: full KV writes ``tokens`` tokens (greedy); every policy then reads the
        same tokens back one at a time (teacher forcing, its decode-time eviction running) and
        is scored on them: top-1 agreement with full KV, the tokens' mean negative log-likelihood,
        decoding speed and the KV held at the end."""
        from kvsnap.engine import SamplingParams

        prompt = self.engine.encode(case.turns[0])
        reference = self.engine.turn(
            self.engine.new_session("full"), prompt, SamplingParams(max_new_tokens=tokens)
        ).tokens
        out = []
        for spec in specs:
            policy, recompress, kivi = spec.build(window)
            session = self.engine.new_session(policy, recompress=recompress)
            logits = self.engine.prefill(session, prompt)
            if kivi:
                round_trip(self.engine, session, kivi)  # the document resumed from a quantized tier
            agree, nll, decode_s, most = 0, 0.0, 0.0, 0
            for token in reference:
                agree += int(logits.argmax()) == token
                nll -= float(logits.log_softmax(-1)[token])
                t0 = time.perf_counter()
                logits = self.engine.force(session, token)
                decode_s += time.perf_counter() - t0
                most = max(most, session.kept_len)
            out.append(
                {
                    "policy": spec.name,
                    "tokens": len(reference),
                    "agreement": agree / max(1, len(reference)),
                    "nll": nll / max(1, len(reference)),
                    "decode_tok_s": len(reference) / decode_s if decode_s else 0.0,
                    "kv_bytes": packed_bytes(session, kivi) if kivi else session.kv_bytes,  # at the end
                    "full_kv_bytes": session.full_kv_bytes,
                    "kept_len_max": most,
                    "logical_len": session.logical_len,
                }
            )
        return out


def packed_bytes(session, kivi) -> int:
    """Bytes a KIVI-quantized tier would hold for the session's KV as it is now."""
    return _at_rest(session).packed(kivi).nbytes


def round_trip(engine, session, kivi) -> int:
    """Put the session's KV through a KIVI-quantized tier and back (what a resumed session gets);
    returns the bytes the tier held."""
    from kvsnap.engine.cache import import_kv

    packed = _at_rest(session).packed(kivi)  # what the tier stores (store/tiers.py)
    session.cache = import_kv(engine.model.config, packed.unpacked().tensors, session.logical_len, packed.cold)
    return packed.nbytes


def _at_rest(session):
    """The session's KV as a tier blob."""
    from kvsnap.engine.cache import export_kv
    from kvsnap.engine.cold import export_cold
    from kvsnap.store.tiers import KVBlob

    return KVBlob(export_kv(session.cache), session.logical_len, version=0, cold=export_cold(session.cache))


class OverHTTP:
    """Runs cases against a running service with ``x-session-id``: ``/v1/completions`` (raw text),
    or ``/v1/chat/completions`` for a chat case (one user message per turn)."""

    def __init__(self, url: str, api_key: str, model: str | None = None, timeout_s: float = 600.0):
        import requests

        self.url = url.rstrip("/")
        self.http = requests.Session()
        self.http.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout_s = timeout_s
        self.model = model or self.http.get(f"{self.url}/v1/models", timeout=30).json()["data"][0]["id"]

    def run(self, case: Case, spec: PolicySpec, window: int) -> list[dict]:
        if spec.quant:
            raise InvalidArgument(f"{spec.name}: a service quantizes its tiers per deployment (kv_quant), not per turn")
        if case.opening:
            raise InvalidArgument("the docfirst task runs in-process only (its document turn generates nothing)")
        sid = f"eval-{uuid.uuid4().hex[:16]}"
        headers = {"x-session-id": sid}
        out = []
        ask = self._chat if case.chat else self._complete
        try:
            history: list = []
            for text in case.turns:
                t0 = time.perf_counter()
                answer = ask(history, text, headers, spec.settings(window))
                state = self.http.get(f"{self.url}/v1/sessions/{sid}", timeout=30).json()
                out.append(
                    {
                        "text": answer,
                        "latency_s": time.perf_counter() - t0,
                        "context_tokens": state["logical_len"],
                        "kv_bytes": state["kv_bytes"],
                        "full_kv_bytes": 0,  # the service reports what it holds, not the counterfactual
                    }
                )
        finally:
            self.http.delete(f"{self.url}/v1/sessions/{sid}", timeout=30)
        return out

    def _complete(self, history: list, text: str, headers: dict, settings: dict) -> str:
        """The raw-text session form: the prompt is everything so far (``history`` holds it)."""
        prompt = "".join(history) + text
        body = {"prompt": prompt, "max_tokens": ANSWER_TOKENS}
        completion = self._post("/v1/completions", body, headers, settings)["choices"][0]["text"]
        history[:] = [prompt + completion]
        return completion

    def _chat(self, history: list, text: str, headers: dict, settings: dict) -> str:
        """One user message under the model's chat template (``history``: the messages so far)."""
        history.append({"role": "user", "content": text})
        body = {"messages": history, "max_tokens": CHAT_ANSWER_TOKENS}
        answer = self._post("/v1/chat/completions", body, headers, settings)["choices"][0]["message"]["content"]
        history.append({"role": "assistant", "content": answer})
        return answer

    def _post(self, route: str, body: dict, headers: dict, settings: dict) -> dict:
        body = body | {"model": self.model, "temperature": 0, "kvsnap": settings}
        r = self.http.post(f"{self.url}{route}", headers=headers, json=body, timeout=self.timeout_s)
        if r.status_code != 200:
            raise RuntimeError(f"service answered {r.status_code}: {r.text[:300]}")
        return r.json()
