"""The quality harness behind ``kvsnap eval``: what answer quality a KV policy costs.

Three synthetic tasks, generated locally (``tasks.py``), no downloads:

- ``passkey``: one 5-digit key planted at a depth of a filler document; one question.
- ``multikey``: several named keys planted across the document; one question about one of them.
- ``multiturn``: the same document; the first turn asks for one key, every follow-up for
  another one (what a RAG session does, and where prompt-based compression is weakest:
  SnapKV chose what to keep by looking at the first question).

Every policy runs the same prompts in one run; an answer is right when the generated text
contains the key. The first turn is document + question in one prompt (so SnapKV's
observation window is the question); follow-ups are appended as raw text. Two backends:
in-process (an :class:`Engine`) or a running service (``/v1/completions`` with
``x-session-id``, the raw-text session form), which tokenize a turn the same way.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import time
import uuid
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvsnap.errors import InvalidArgument

from .tasks import multi_key_prompt, pass_key_prompt

RETRIEVAL_TASKS = ("passkey", "multikey", "multiturn")
TASKS = (*RETRIEVAL_TASKS, "longgen")
ANSWER_TOKENS = 8  # a 5-digit key and a little more
LONGGEN_PROMPT = "\n\nA detailed account of everything in the text above, sentence by sentence:\n"


def _spec_names() -> tuple[list[str], list[str]]:
    """The prefill and decode policy names a spec may use: every registered policy (a policy
    registered by a module of one's own too), and ``reselect`` (SnapKV re-selecting per turn)."""
    from kvsnap.policies import POLICIES, evictor_names

    return ["reselect", *sorted(n for n in POLICIES if n != "full")], evictor_names()


def _spec_pattern() -> re.Pattern:
    prefill, decode = _spec_names()
    return re.compile(
        rf"^(?P<policy>full|(?:{'|'.join(prefill)}):(?P<budget>[1-9][0-9]*))"
        rf"(?:\+(?P<decode>{'|'.join(decode)}):(?P<decode_budget>[1-9][0-9]*))?"
        r"(?:@(?P<quant>kivi2|kivi4))?$"
    )


SINKS = 4  # streaming's attention sinks, here and as a decode-time policy


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """A policy named on the command line: ``<prefill>[+<decode>:<budget>][@kivi2|@kivi4]``.

    Prefill: ``full`` | ``snapkv:B`` | ``reselect:B`` | ``streaming:B`` | ``h2o:B`` |
    ``scissorhands:B``. Each compressing one holds B + the observation window rows per KV
    head after prefill, a like-for-like comparison:

    - ``reselect:B`` is SnapKV with budget B that re-selects every turn from the full cache
      kept in the host tier (``recompress="reselect"``); ``snapkv:B`` re-selects from what it kept.
    - ``streaming:B`` keeps 4 sink rows and a recent window of B + window - 4 rows.
    - ``h2o:B`` / ``scissorhands:B``: B rows by their rule, plus the window as the recent rows;
      they also evict while decoding (capacity B + window).

    ``+h2o:D`` / ``+scissorhands:D`` / ``+streaming:D``: evict while decoding with that policy,
    capacity D + window (e.g. ``snapkv:256+h2o:128``). ``@kivi2`` / ``@kivi4``: the session's KV
    is KIVI-quantized between turns, as a quantized host tier stores it (in-process only; a
    service quantizes per deployment, ``kv_quant``). A first turn is never affected by it.
    """

    name: str
    policy: str
    budget: int = 0
    decode: str = ""
    decode_budget: int = 0
    quant: str = ""

    @classmethod
    def parse(cls, text: str) -> PolicySpec:
        m = _spec_pattern().match(text.strip())
        if m is None:
            prefill, decode = _spec_names()
            raise InvalidArgument(
                f"policy spec {text!r}: use full or <policy>:<budget> with policy one of {', '.join(prefill)}, "
                f"optionally +<decoder>:<budget> ({', '.join(decode)}) and @kivi2 or @kivi4"
            )
        policy = m["policy"].partition(":")[0]
        return cls(
            text.strip(),
            policy,
            int(m["budget"] or 0),
            m["decode"] or "",
            int(m["decode_budget"] or 0),
            m["quant"] or "",
        )

    def settings(self, window: int) -> dict:
        """The session settings (as the API takes them) that realise this spec (``@kivi`` aside)."""
        if self.policy == "full":
            out = {"policy": "full"}
        elif self.policy in ("snapkv", "reselect"):  # the paper's pooling, spelled out: a service may differ
            recompress = "reselect" if self.policy == "reselect" else "per_turn"
            snapkv = {"policy": "snapkv", "budget": self.budget, "window": window, "kernel": 7, "pooling": "max"}
            out = snapkv | {"recompress": recompress}
        elif self.policy == "streaming":
            out = {"policy": "streaming", "window": self.budget + window - SINKS, "sinks": SINKS}
        else:  # h2o, scissorhands, and any registered policy with a budget and a window
            out = {"policy": self.policy, "budget": self.budget, "window": window}
        if self.decode == "streaming":
            out["decode"] = {"policy": "streaming", "window": self.decode_budget + window - SINKS, "sinks": SINKS}
        elif self.decode:
            out["decode"] = {"policy": self.decode, "budget": self.decode_budget, "window": window}
        return out

    def build(self, window: int):
        """(policy, recompress, KIVI or None) for an in-process session."""
        from kvsnap.policies import make_policy
        from kvsnap.policies.kivi import parse_kivi

        settings = self.settings(window)
        recompress = settings.pop("recompress", "per_turn")
        return make_policy(settings.pop("policy"), **settings), recompress, parse_kivi(self.quant)


@dataclass(frozen=True, slots=True)
class Case:
    """One conversation: the first turn carries the document; each turn expects one key."""

    task: str
    length: int  # target document tokens
    seed: int
    turns: tuple[str, ...]
    answers: tuple[str, ...]
    depths: tuple[float, ...]  # where each turn's key sits in the document (0 = start)


@dataclass(slots=True)
class TurnScore:
    task: str
    policy: str
    length: int
    seed: int
    turn: int
    depth: float
    correct: bool
    answer: str
    text: str
    latency_s: float
    context_tokens: int = 0
    kv_bytes: int = 0
    full_kv_bytes: int = 0


@dataclass(slots=True)
class EvalSpec:
    tasks: tuple[str, ...] = RETRIEVAL_TASKS
    lengths: tuple[int, ...] = (1024, 2048, 4096)
    depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    policies: tuple[str, ...] = ("full", "snapkv:128", "snapkv:256", "snapkv:512", "streaming:256")
    keys: int = 4
    seeds: int = 2
    window: int = 32
    gen_tokens: int = 256  # longgen: tokens generated after the document
    specs: list[PolicySpec] = field(init=False)

    def __post_init__(self) -> None:
        unknown = set(self.tasks) - set(TASKS)
        if unknown:
            raise InvalidArgument(f"unknown task(s) {sorted(unknown)}; valid: {list(TASKS)}")
        if not self.lengths or min(self.lengths) < 64:
            raise InvalidArgument("lengths must be given and each at least 64 tokens")
        if any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise InvalidArgument("depths must lie in [0, 1]")
        if not 2 <= self.keys <= 8 or self.seeds < 1:
            raise InvalidArgument("keys must be in [2, 8] and seeds >= 1")
        if self.gen_tokens < 1:
            raise InvalidArgument("gen_tokens must be >= 1")
        self.specs = [PolicySpec.parse(p) for p in self.policies]


def build_cases(tokenizer, spec: EvalSpec) -> list[Case]:
    cases = []
    for length in spec.lengths:
        for seed in range(spec.seeds):
            if "passkey" in spec.tasks:
                for depth in spec.depths:
                    p = pass_key_prompt(tokenizer, target_tokens=length, depth=depth, seed=seed * 1000 + length)
                    cases.append(Case("passkey", length, seed, (p.document + p.question,), (p.answer,), (depth,)))
            mk = multi_key_prompt(tokenizer, target_tokens=length, keys=spec.keys, seed=seed * 1000 + length)
            if "multikey" in spec.tasks:
                for j in range(spec.keys):  # every key once: every depth slice is asked
                    turn = (mk.document + mk.question(j),)
                    cases.append(Case("multikey", length, seed, turn, (mk.answers[j],), (mk.depths[j],)))
            if "multiturn" in spec.tasks:
                order = [(seed + i) % spec.keys for i in range(spec.keys)]  # the first question varies by seed
                turns = tuple((mk.document if i == 0 else "") + mk.question(j) for i, j in enumerate(order))
                answers = tuple(mk.answers[j] for j in order)
                cases.append(Case("multiturn", length, seed, turns, answers, tuple(mk.depths[j] for j in order)))
            if "longgen" in spec.tasks:
                cases.append(Case("longgen", length, seed, (mk.document + LONGGEN_PROMPT,), (), ()))
    return cases


# -- backends: run one case under one policy, return what each turn answered ----------------


class InProcess:
    """Runs cases on an :class:`Engine` in this process."""

    def __init__(self, engine):
        self.engine = engine

    def run(self, case: Case, spec: PolicySpec, window: int) -> list[dict]:
        from kvsnap.engine import SamplingParams

        policy, recompress, kivi = spec.build(window)
        session = self.engine.new_session(policy, recompress=recompress)
        out = []
        for i, text in enumerate(case.turns):
            t0 = time.perf_counter()
            result = self.engine.turn(
                session, self.engine.encode(text, first=i == 0), SamplingParams(max_new_tokens=ANSWER_TOKENS)
            )
            r = result.report
            stored = round_trip(self.engine, session, kivi) if kivi else r.kv_bytes  # as the tier holds it
            out.append(
                {
                    "text": result.text,
                    "latency_s": time.perf_counter() - t0,
                    "context_tokens": r.logical_len,
                    "kv_bytes": stored,
                    "full_kv_bytes": r.full_kv_bytes,
                }
            )
        return out

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
    session.cache = import_kv(engine.model.config, packed.unpacked().tensors, session.logical_len)
    return packed.nbytes


def _at_rest(session):
    """The session's KV as a tier blob."""
    from kvsnap.engine.cache import export_kv
    from kvsnap.store.tiers import KVBlob

    return KVBlob(export_kv(session.cache), session.logical_len, version=0)


class OverHTTP:
    """Runs cases against a running service through ``/v1/completions`` with ``x-session-id``."""

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
        sid = f"eval-{uuid.uuid4().hex[:16]}"
        headers = {"x-session-id": sid}
        prompt, out = "", []
        try:
            for text in case.turns:
                prompt += text
                t0 = time.perf_counter()
                r = self.http.post(
                    f"{self.url}/v1/completions",
                    headers=headers,
                    json={
                        "model": self.model,
                        "prompt": prompt,
                        "max_tokens": ANSWER_TOKENS,
                        "temperature": 0,
                        "kvsnap": spec.settings(window),
                    },
                    timeout=self.timeout_s,
                )
                if r.status_code != 200:
                    raise RuntimeError(f"service answered {r.status_code}: {r.text[:300]}")
                completion = r.json()["choices"][0]["text"]
                prompt += completion
                state = self.http.get(f"{self.url}/v1/sessions/{sid}", timeout=30).json()
                out.append(
                    {
                        "text": completion,
                        "latency_s": time.perf_counter() - t0,
                        "context_tokens": state["logical_len"],
                        "kv_bytes": state["kv_bytes"],
                        "full_kv_bytes": 0,  # the service reports what it holds, not the counterfactual
                    }
                )
        finally:
            self.http.delete(f"{self.url}/v1/sessions/{sid}", timeout=30)
        return out


@dataclass(slots=True)
class GenScore:
    policy: str
    length: int
    seed: int
    tokens: int
    agreement: float  # share of generated tokens where the policy's top-1 equals full KV's token
    nll: float  # mean negative log-likelihood of full KV's tokens under the policy
    decode_tok_s: float
    kv_bytes: int  # KV held at the end (as a quantized tier holds it, for @kivi)
    full_kv_bytes: int
    kept_len_max: int  # most rows a full-attention layer held after any decoding step
    logical_len: int


def evaluate(backend, cases: list[Case], spec: EvalSpec, progress=None) -> list[TurnScore | GenScore]:
    """Every case under every policy (policies interleaved per case, so drift hits all alike)."""
    scores = []
    for n, case in enumerate(cases, 1):
        if case.task == "longgen":
            if not hasattr(backend, "generate"):
                raise InvalidArgument("the longgen task runs in-process only (it reads tokens back one at a time)")
            for row in backend.generate(case, spec.specs, spec.window, spec.gen_tokens):
                scores.append(GenScore(length=case.length, seed=case.seed, **row))
            if progress:
                progress(f"[{n}/{len(cases)}] {case.task} L={case.length} seed={case.seed} done")
            continue
        for policy in spec.specs:
            for i, turn in enumerate(backend.run(case, policy, spec.window)):
                scores.append(
                    TurnScore(
                        task=case.task,
                        policy=policy.name,
                        length=case.length,
                        seed=case.seed,
                        turn=i + 1,
                        depth=case.depths[i],
                        correct=case.answers[i] in turn["text"],
                        answer=case.answers[i],
                        **turn,
                    )
                )
        if progress:
            progress(f"[{n}/{len(cases)}] {case.task} L={case.length} seed={case.seed} done")
    return scores


# -- reporting --------------------------------------------------------------------------------


def summarize(scores: list[TurnScore | GenScore]) -> dict:
    """Accuracy (0..1) per task and policy: overall, per length, per depth, per turn; KV held.
    Long generation: agreement with full KV, perplexity of its tokens, decode speed, KV held."""

    def acc(rows):
        return sum(r.correct for r in rows) / len(rows)

    groups = defaultdict(list)
    out = {}
    for s in scores:
        if isinstance(s, GenScore):
            groups[("longgen", s.policy)].append(s)
        else:
            groups[(s.task, s.policy)].append(s)
    for (task, policy), rows in list(groups.items()):
        if task == "longgen":
            out.setdefault(task, {})[policy] = {
                "agreement": statistics.mean(r.agreement for r in rows),
                "perplexity": math.exp(statistics.mean(r.nll for r in rows)),
                "tokens_mean": statistics.mean(r.tokens for r in rows),
                "decode_tok_s_median": statistics.median(r.decode_tok_s for r in rows),
                "kv_bytes_mean": statistics.mean(r.kv_bytes for r in rows),
                "full_kv_bytes_mean": statistics.mean(r.full_kv_bytes for r in rows),
                "kept_len_max": max(r.kept_len_max for r in rows),
                "per_length": {
                    str(k): statistics.mean(r.agreement for r in rows if r.length == k)
                    for k in sorted({r.length for r in rows})
                },
                "n": len(rows),
            }
            del groups[(task, policy)]
    for (task, policy), rows in groups.items():
        by = {key: defaultdict(list) for key in ("length", "depth", "turn")}
        for r in rows:
            by["length"][r.length].append(r)
            by["depth"][_depth_bin(r)].append(r)
            by["turn"][r.turn].append(r)
        last_turns = [r for r in rows if r.turn == max(x.turn for x in rows if x.seed == r.seed)]
        follow_ups = [r for r in rows if r.turn > 1]
        out.setdefault(task, {})[policy] = {
            "accuracy": acc(rows),
            "follow_up_accuracy": acc(follow_ups) if follow_ups else None,  # turns after the first
            "n": len(rows),
            "per_length": {str(k): acc(v) for k, v in sorted(by["length"].items())},
            "per_depth": {str(k): acc(v) for k, v in sorted(by["depth"].items())},
            "per_turn": {str(k): acc(v) for k, v in sorted(by["turn"].items())},
            "kv_bytes_mean": statistics.mean(r.kv_bytes for r in last_turns),
            "latency_s_median": statistics.median(r.latency_s for r in rows),
        }
    return out


def _depth_bin(score: TurnScore) -> str:
    """Pass-key depths are the ones asked for; planted-key depths are random: quarters of the document."""
    if score.task == "passkey":
        return f"{score.depth:g}"
    quarter = min(3, int(score.depth * 4))
    return f"{quarter / 4:.2f}-{(quarter + 1) / 4:.2f}"


def format_tables(summary: dict) -> str:
    lines = []
    for task, per_policy in summary.items():
        if task == "longgen":
            lines += _longgen_table(per_policy)
            continue
        first = next(iter(per_policy.values()))
        lengths = list(first["per_length"])
        turns = list(first["per_turn"]) if task == "multiturn" else []
        width = max(16, 2 + max(map(len, per_policy)))
        head = f"{'policy':{width}}{'acc':>7}" + "".join(f"{'L=' + k:>9}" for k in lengths)
        head += (
            "".join(f"{'turn ' + k:>9}" for k in turns) + (f"{'follow-ups':>11}" if turns else "") + f"{'KV MiB':>9}"
        )
        lines += ["", f"{task}  (accuracy; KV held at the end of a case, mean)", head]
        for policy, s in per_policy.items():
            row = f"{policy:{width}}{s['accuracy']:>7.0%}" + "".join(f"{s['per_length'][k]:>9.0%}" for k in lengths)
            row += "".join(f"{s['per_turn'][k]:>9.0%}" for k in turns)
            row += (f"{s['follow_up_accuracy']:>11.0%}" if turns else "") + f"{s['kv_bytes_mean'] / 2**20:>9.2f}"
            lines.append(row)
        lines.append(f"{'  by depth':{width}}" + "".join(f"{k:>11}" for k in first["per_depth"]))
        for policy, s in per_policy.items():
            lines.append(f"  {policy:{width - 2}}" + "".join(f"{v:>11.0%}" for v in s["per_depth"].values()))
    return "\n".join(lines)


def _longgen_table(per_policy: dict) -> list[str]:
    first = next(iter(per_policy.values()))
    tokens = first["tokens_mean"]
    width = max(16, 2 + max(map(len, per_policy)))
    head = f"{'policy':{width}}{'agree':>7}" + "".join(f"{'L=' + k:>9}" for k in first["per_length"])
    head += f"{'ppl':>8}{'tok/s':>8}{'rows max':>10}{'KV MiB':>9}{'full MiB':>10}"
    lines = ["", f"longgen  ({tokens:.0f} tokens written with full KV, read back by each policy)", head]
    for policy, s in per_policy.items():
        row = f"{policy:{width}}{s['agreement']:>7.1%}" + "".join(f"{v:>9.1%}" for v in s["per_length"].values())
        row += f"{s['perplexity']:>8.3f}{s['decode_tok_s_median']:>8.1f}{s['kept_len_max']:>10}"
        row += f"{s['kv_bytes_mean'] / 2**20:>9.2f}{s['full_kv_bytes_mean'] / 2**20:>10.2f}"
        lines.append(row)
    return lines


def plot(summary: dict, path: Path) -> bool:
    """Accuracy curves of the retrieval tasks; False when there are none to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = {task: v for task, v in summary.items() if task != "longgen"}  # a table, not a curve
    if not summary:
        return False
    fig, axes = plt.subplots(1, len(summary), figsize=(5 * len(summary), 3.8), squeeze=False)
    for ax, (task, per_policy) in zip(axes[0], summary.items(), strict=True):
        key = "per_turn" if task == "multiturn" else "per_length"
        for n, (policy, s) in enumerate(per_policy.items()):  # distinct markers: equal lines stay visible
            ax.plot(list(s[key]), [100 * v for v in s[key].values()], marker="os^vDxP*"[n % 8], label=policy,
                    markersize=9 - n, alpha=0.8)  # fmt: skip
        ax.set_title(task)
        ax.set_xlabel("turn" if key == "per_turn" else "context tokens")
        ax.set_ylabel("accuracy %")
        ax.set_ylim(-5, 105)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def save(scores: list[TurnScore], summary: dict, meta: dict, out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "quality.json", "png": out_dir / "quality.png"}
    paths["json"].write_text(
        json.dumps({"meta": meta, "summary": summary, "turns": [asdict(s) for s in scores]}, indent=1)
    )
    if not plot(summary, paths["png"]):
        del paths["png"]
    return paths
