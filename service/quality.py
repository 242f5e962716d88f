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
import statistics
import time
import uuid
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvsnap.errors import InvalidArgument

from .tasks import multi_key_prompt, pass_key_prompt

TASKS = ("passkey", "multikey", "multiturn")
ANSWER_TOKENS = 8  # a 5-digit key and a little more


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """A policy named on the command line: ``full`` | ``snapkv:<budget>`` | ``reselect:<budget>`` |
    ``streaming:<budget>``.

    ``reselect:B`` is SnapKV with budget B that re-selects every turn from the full cache kept
    in the host tier (``recompress="reselect"``); ``snapkv:B`` re-selects from what it kept.

    ``streaming:B`` keeps 4 sink rows and a recent window sized so that it holds as many
    rows as ``snapkv:B`` does (B + the observation window), a like-for-like comparison.
    """

    name: str
    policy: str
    budget: int = 0

    @classmethod
    def parse(cls, text: str) -> PolicySpec:
        policy, _, budget = text.strip().partition(":")
        if policy == "full" and not budget:
            return cls(text.strip(), "full")
        if policy in ("snapkv", "reselect", "streaming") and budget.isdigit() and int(budget) > 0:
            return cls(text.strip(), policy, int(budget))
        raise InvalidArgument(
            f"policy spec {text!r}: use full, snapkv:<budget>, reselect:<budget> or streaming:<budget>"
        )

    def settings(self, window: int) -> dict:
        """The session settings (as the API takes them) that realise this spec."""
        if self.policy == "full":
            return {"policy": "full"}
        if self.policy in ("snapkv", "reselect"):  # the paper's pooling, spelled out: a service may differ
            recompress = "reselect" if self.policy == "reselect" else "per_turn"
            snapkv = {"policy": "snapkv", "budget": self.budget, "window": window, "kernel": 7, "pooling": "max"}
            return snapkv | {"recompress": recompress}
        return {"policy": "streaming", "window": self.budget + window - 4}


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
    tasks: tuple[str, ...] = TASKS
    lengths: tuple[int, ...] = (1024, 2048, 4096)
    depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    policies: tuple[str, ...] = ("full", "snapkv:128", "snapkv:256", "snapkv:512", "streaming:256")
    keys: int = 4
    seeds: int = 2
    window: int = 32
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
    return cases


# -- backends: run one case under one policy, return what each turn answered ----------------


class InProcess:
    """Runs cases on an :class:`Engine` in this process."""

    def __init__(self, engine):
        self.engine = engine

    def run(self, case: Case, spec: PolicySpec, window: int) -> list[dict]:
        from kvsnap.actors import SamplingParams
        from kvsnap.policies import make_policy

        settings = spec.settings(window)
        recompress = settings.pop("recompress", "per_turn")
        session = self.engine.new_session(make_policy(settings.pop("policy"), **settings), recompress=recompress)
        out = []
        for i, text in enumerate(case.turns):
            t0 = time.perf_counter()
            result = self.engine.turn(
                session, self.engine.encode(text, first=i == 0), SamplingParams(max_new_tokens=ANSWER_TOKENS)
            )
            r = result.report
            out.append(
                {
                    "text": result.text,
                    "latency_s": time.perf_counter() - t0,
                    "context_tokens": r.logical_len,
                    "kv_bytes": r.kv_bytes,
                    "full_kv_bytes": r.full_kv_bytes,
                }
            )
        return out


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


def evaluate(backend, cases: list[Case], spec: EvalSpec, progress=None) -> list[TurnScore]:
    """Every case under every policy (policies interleaved per case, so drift hits all alike)."""
    scores = []
    for n, case in enumerate(cases, 1):
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


def summarize(scores: list[TurnScore]) -> dict:
    """Accuracy (0..1) per task and policy: overall, per length, per depth, per turn; KV held."""

    def acc(rows):
        return sum(r.correct for r in rows) / len(rows)

    groups = defaultdict(list)
    for s in scores:
        groups[(s.task, s.policy)].append(s)
    out = {}
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
        first = next(iter(per_policy.values()))
        lengths = list(first["per_length"])
        turns = list(first["per_turn"]) if task == "multiturn" else []
        head = f"{'policy':16}{'acc':>7}" + "".join(f"{'L=' + k:>9}" for k in lengths)
        head += (
            "".join(f"{'turn ' + k:>9}" for k in turns) + (f"{'follow-ups':>11}" if turns else "") + f"{'KV MiB':>9}"
        )
        lines += ["", f"{task}  (accuracy; KV held at the end of a case, mean)", head]
        for policy, s in per_policy.items():
            row = f"{policy:16}{s['accuracy']:>7.0%}" + "".join(f"{s['per_length'][k]:>9.0%}" for k in lengths)
            row += "".join(f"{s['per_turn'][k]:>9.0%}" for k in turns)
            row += (f"{s['follow_up_accuracy']:>11.0%}" if turns else "") + f"{s['kv_bytes_mean'] / 2**20:>9.2f}"
            lines.append(row)
        lines.append(f"{'  by depth':16}" + "".join(f"{k:>11}" for k in first["per_depth"]))
        for policy, s in per_policy.items():
            lines.append(f"  {policy:14}" + "".join(f"{v:>11.0%}" for v in s["per_depth"].values()))
    return "\n".join(lines)


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def save(scores: list[TurnScore], summary: dict, meta: dict, out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "quality.json", "png": out_dir / "quality.png"}
    paths["json"].write_text(
        json.dumps({"meta": meta, "summary": summary, "turns": [asdict(s) for s in scores]}, indent=1)
    )
    plot(summary, paths["png"])
    return paths
