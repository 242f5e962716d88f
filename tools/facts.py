"""Fact retrieval: a long document in varied prose that states a few facts once each, asked
one per turn over the model's chat template (``kvsnap eval --tasks facts``).

What a RAG user does, and what a pass-key prompt does not test: the filler is not one
repeated sentence (a model and a compression policy both find repetition easy to skip),
every fact is stated exactly once, and the facts are spans of several tokens in four kinds
(a 5-digit number, a person's name, an alphanumeric code, a city), where a tokenizer that writes
digits one token each makes a number five separate rows. An answer is right when it
contains the fact's value (for a name, the family name). Generated locally from a seed:
no downloads. The prose is drawn from word lists, with no digits and none of the facts'
subjects, so nothing in the filler answers or mimics a question.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SUBJECTS = (
    "The committee", "The survey team", "Our engineers", "The harbour office", "The regional council",
    "A visiting delegation", "The night shift", "The archive staff", "The planning group", "Local farmers",
    "The maintenance crew", "The audit panel", "Several volunteers", "The research unit", "The tenants",
)  # fmt: skip
VERBS = (
    "reviewed", "discussed", "postponed", "approved", "inspected", "questioned", "described", "repaired",
    "measured", "documented", "praised", "criticised", "rebuilt", "catalogued", "delayed",
)  # fmt: skip
OBJECTS = (
    "the drainage plan", "the old bridge", "the winter schedule", "the library roof", "the ferry timetable",
    "the orchard fence", "the budget draft", "the water supply", "the street lighting", "the school garden",
    "the storage depot", "the market square", "the signal tower", "the river embankment", "the bus depot",
)  # fmt: skip
CLAUSES = (
    "after a long and careful debate", "before the first frost arrived", "despite the heavy rain",
    "while the main road was closed", "as the season came to an end", "without much public notice",
    "following several complaints", "under the supervision of the board", "in the quiet hours of the morning",
    "with help from the neighbouring towns", "to the surprise of most residents", "once the funds were released",
)  # fmt: skip
REMARKS = (
    "Nobody expected the work to take so long.", "The weather stayed mild for most of the week.",
    "Opinions in the town were divided.", "A short report was sent to every household.",
    "The minutes of the meeting were filed the same evening.", "Most people agreed it was overdue.",
    "Some of the older residents remembered a similar case.", "The newspaper printed a brief note about it.",
    "Further details will follow in the next bulletin.", "The cost remained within the agreed limits.",
)  # fmt: skip

# the facts: (kind, sentence, question, answer); subjects are drawn without repeats
_PLACES = ("north gate", "east warehouse", "river lock", "clock tower", "seed vault", "old mill",
           "signal box", "pump house", "west pier", "glass house")  # fmt: skip
_ROLES = (("treasurer", "rowing club"), ("curator", "town museum"), ("head nurse", "county clinic"),
          ("chief judge", "flower show"), ("captain", "lifeboat crew"), ("director", "choir school"),
          ("warden", "nature reserve"), ("editor", "weekly gazette"))  # fmt: skip
_FIRST = ("Marta", "Tomas", "Ingrid", "Kofi", "Lena", "Ravi", "Sofia", "Anton", "Yuki", "Pablo")
_LAST = ("Okafor", "Lindqvist", "Moreau", "Castellan", "Nakamura", "Brennan", "Varga", "Haddad", "Ferreira")
_CARGO = ("the copper wire", "the spare engines", "the medical kits", "the violin strings", "the glass panels",
          "the wool blankets", "the seed potatoes", "the marble tiles")  # fmt: skip
_EVENTS = ("spring conference", "chess final", "glass fair", "choir festival", "rowing regatta", "kite contest")
_CITIES = ("Lisbon", "Tallinn", "Valparaiso", "Winnipeg", "Helsinki", "Trondheim", "Adelaide", "Ljubljana",
           "Cartagena", "Kyoto")  # fmt: skip
_LETTERS = "ABCDEFGHJKLMNPRSTUVWXYZ"
FACT_KINDS = ("number", "name", "code", "city")


@dataclass(frozen=True, slots=True)
class Fact:
    kind: str  # number | name | code
    sentence: str  # how the document states it (once)
    question: str
    answer: str  # what a right answer contains


@dataclass(frozen=True, slots=True)
class FactsDocument:
    document: str
    facts: tuple[Fact, ...]  # facts[i] is stated at depths[i]
    depths: tuple[float, ...]


def make_fact(kind: str, rng: random.Random, used: set[str]) -> Fact:
    """One fact of ``kind`` whose subject is not in ``used`` (added to it)."""
    if kind == "number":
        place = _fresh(rng, _PLACES, used)
        value = str(rng.randint(10000, 99999))
        return Fact(kind, f"The access code for the {place} is {value}.",
                    f"What is the access code for the {place}?", value)  # fmt: skip
    if kind == "name":
        role, org = _fresh(rng, _ROLES, used)
        first, last = rng.choice(_FIRST), _fresh(rng, _LAST, used)
        return Fact(kind, f"The {role} of the {org} is {first} {last}.", f"Who is the {role} of the {org}?", last)
    if kind == "code":
        cargo = _fresh(rng, _CARGO, used)
        value = f"{rng.choice(_LETTERS)}{rng.choice(_LETTERS)}-{rng.randint(1000, 9999)}"
        return Fact(kind, f"The shipment of {cargo} has the tracking code {value}.",
                    f"What is the tracking code of the shipment of {cargo}?", value)  # fmt: skip
    if kind == "city":
        event, city = _fresh(rng, _EVENTS, used), _fresh(rng, _CITIES, used)
        return Fact(kind, f"This year the {event} will be held in {city}.",
                    f"In which city will the {event} be held this year?", city)  # fmt: skip
    raise ValueError(f"unknown fact kind {kind!r}; valid: {FACT_KINDS}")


def _fresh(rng: random.Random, options: tuple, used: set[str]):
    choice = rng.choice([o for o in options if str(o) not in used])
    used.add(str(choice))
    return choice


def filler_sentence(rng: random.Random) -> str:
    if rng.random() < 0.2:
        return rng.choice(REMARKS)
    return f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(CLAUSES)}."


def facts_document(tokenizer, target_tokens: int = 2048, facts: int = 4, seed: int = 0) -> FactsDocument:
    """About ``target_tokens`` tokens of prose stating ``facts`` facts once each, fact i in the
    i-th of ``facts`` equal slices of the document (kinds taken in turn: number, name, code, city)."""
    if not 1 <= facts <= 8:
        raise ValueError("facts must be in [1, 8]")
    rng = random.Random(seed)
    used: set[str] = set()
    chosen = tuple(make_fact(FACT_KINDS[(seed + i) % len(FACT_KINDS)], rng, used) for i in range(facts))
    sentences: list[str] = []
    length = len(tokenizer.encode(" ".join(f.sentence for f in chosen), add_special_tokens=False))
    while length < target_tokens:
        s = filler_sentence(rng)
        sentences.append(s)
        length += len(tokenizer.encode(" " + s, add_special_tokens=False))
    depths = tuple((i + rng.uniform(0.1, 0.9)) / facts for i in range(facts))
    for depth, fact in sorted(zip(depths, chosen, strict=True), key=lambda p: -p[0]):
        sentences.insert(round(depth * len(sentences)), fact.sentence)
    paragraphs = [" ".join(sentences[i : i + 6]) for i in range(0, len(sentences), 6)]
    return FactsDocument("\n\n".join(paragraphs), chosen, depths)


def first_question(document: str, question: str) -> str:
    """The first turn's user message: the document, then its question."""
    return f"Read the report below and answer the question after it.\n\n{document}\n\nQuestion: {question}"
