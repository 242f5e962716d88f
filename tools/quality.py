"""The quality harness behind ``kvsnap eval``: what answer quality a KV policy costs.

Three synthetic tasks, generated locally (``tasks.py``), no downloads:

- ``passkey``: one 5-digit key planted at a depth of a filler document; one question.
- ``multikey``: several named keys planted across the document; one question about one of them.
- ``multiturn``: the same document; the first turn asks for one key, every follow-up for
  another one (what a RAG session does, and where prompt-based compression is weakest:
  SnapKV chose what to keep by looking at the first question).
- ``docfirst``: the same document sent alone first (prefilled and compressed with no
  question known, as ``POST /v1/sessions`` opens a session), then one turn per key, each
  about a different one (in-process only).

Every policy runs the same prompts in one run; an answer is right when the generated text
contains the key. The first turn is document + question in one prompt (so SnapKV's
observation window is the question); follow-ups are appended as raw text. Two backends:
in-process (an :class:`Engine`) or a running service (``/v1/completions`` with
``x-session-id``, the raw-text session form), which tokenize a turn the same way.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvsnap.errors import InvalidArgument

from .backends import ANSWER_TOKENS, LONGGEN_PROMPT, InProcess, OverHTTP  # noqa: F401 (kvsnap eval's backends)
from .specs import PolicySpec
from .tasks import multi_key_prompt, pass_key_prompt

RETRIEVAL_TASKS = ("passkey", "multikey", "multiturn")
TASKS = (*RETRIEVAL_TASKS, "docfirst", "longgen")


@dataclass(frozen=True, slots=True)
class Case:
    """One conversation: the first turn carries the document; each turn expects one key."""

    task: str
    length: int  # target document tokens
    seed: int
    turns: tuple[str, ...]
    answers: tuple[str, ...]
    depths: tuple[float, ...]  # where each turn's key sits in the document (0 = start)
    opening: str = ""  # a document sent alone before the turns (prefilled, nothing generated)


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
            if "docfirst" in spec.tasks:
                order = [(seed + i) % spec.keys for i in range(spec.keys)]
                turns = tuple(mk.question(j) for j in order)
                answers = tuple(mk.answers[j] for j in order)
                depths = tuple(mk.depths[j] for j in order)
                cases.append(Case("docfirst", length, seed, turns, answers, depths, opening=mk.document))
            if "longgen" in spec.tasks:
                cases.append(Case("longgen", length, seed, (mk.document + LONGGEN_PROMPT,), (), ()))
    return cases


# -- backends: run one case under one policy, return what each turn answered ----------------


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
        turns = list(first["per_turn"]) if task in ("multiturn", "docfirst") else []
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
