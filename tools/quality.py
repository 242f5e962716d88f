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

from dataclasses import dataclass, field

from kvsnap.errors import InvalidArgument

from .backends import ANSWER_TOKENS, LONGGEN_PROMPT, InProcess, OverHTTP  # noqa: F401 (kvsnap eval's backends)
from .facts import facts_document, first_question
from .report import TURN_TASKS, GenScore, TurnScore, format_tables, save, summarize  # noqa: F401 (re-exported)
from .specs import PolicySpec
from .tasks import Case, multi_key_prompt, pass_key_prompt

RETRIEVAL_TASKS = ("passkey", "multikey", "multiturn")
TASKS = (*RETRIEVAL_TASKS, "docfirst", "facts", "longgen")


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
            if "facts" in spec.tasks:
                cases.append(facts_case(tokenizer, length, seed, spec.keys))
            if "longgen" in spec.tasks:
                cases.append(Case("longgen", length, seed, (mk.document + LONGGEN_PROMPT,), (), ()))
    return cases


def facts_case(tokenizer, length: int, seed: int, facts: int) -> Case:
    """A document stating ``facts`` facts once each, asked one per turn over the chat template;
    the first turn carries the document and its question, and which fact it asks varies by seed."""
    doc = facts_document(tokenizer, target_tokens=length, facts=facts, seed=seed * 1000 + length)
    order = [(seed + i) % facts for i in range(facts)]
    turns = tuple(
        first_question(doc.document, doc.facts[j].question) if i == 0 else doc.facts[j].question
        for i, j in enumerate(order)
    )
    answers = tuple(doc.facts[j].answer for j in order)
    return Case("facts", length, seed, turns, answers, tuple(doc.depths[j] for j in order), chat=True)


# -- backends: run one case under one policy, return what each turn answered ----------------


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
