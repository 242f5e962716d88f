"""Synthetic long-context tasks generated locally (no downloads): pass-key prompts with one
key, or several named keys (multi-key and multi-turn retrieval).

A pass key is planted at a chosen depth inside filler text; the question at the
end asks for it. The quality harness and the CLI demo both build prompts here.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.\n\n"
)


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
    chat: bool = False  # each turn is one user message under the model's chat template (facts)


@dataclass(frozen=True, slots=True)
class PassKeyPrompt:
    document: str  # intro + filler with the key planted
    question: str
    answer: str


def pass_key_prompt(tokenizer, target_tokens: int = 1500, depth: float = 0.5, seed: int = 0) -> PassKeyPrompt:
    """A document of about ``target_tokens`` tokens with a 5-digit pass key at ``depth`` (0 = start, 1 = end)."""
    rng = random.Random(seed)
    key = str(rng.randint(10000, 99999))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    question = "\nWhat is the pass key? The pass key is"
    overhead = len(tokenizer.encode(INTRO + needle + question, add_special_tokens=True))
    per_filler = len(tokenizer.encode(FILLER * 10, add_special_tokens=False)) / 10
    repeats = max(1, int((target_tokens - overhead) / per_filler))
    before = round(repeats * depth)
    document = INTRO + FILLER * before + needle + FILLER * (repeats - before)
    return PassKeyPrompt(document, question, key)


# -- several planted keys: multi-key and multi-turn retrieval ---------------------------------

# Distinct nouns and RULER's "special magic number" phrasing: with colour names ("the red
# box") the embedded 270M model mixed keys up even with full KV (38% vs 100% measured on
# 12 questions at 2K tokens).
KEY_NAMES = ("apple", "river", "castle", "tiger", "violin", "pencil", "rocket", "garden")
NEEDLE = "The special magic number for {name} is {value}. "  # one planted key


@dataclass(frozen=True, slots=True)
class MultiKeyPrompt:
    document: str  # intro + filler with every key planted once
    names: tuple[str, ...]  # names[i] is planted at depths[i]
    answers: tuple[str, ...]
    depths: tuple[float, ...]

    def question(self, i: int) -> str:
        name = self.names[i]
        return f"\nWhat is the special magic number for {name}? The special magic number for {name} is"


def multi_key_prompt(tokenizer, target_tokens: int = 1500, keys: int = 4, seed: int = 0) -> MultiKeyPrompt:
    """A document of about ``target_tokens`` tokens with ``keys`` named 5-digit keys at spread depths.

    Key i sits in the i-th of ``keys`` equal slices of the document (at a random point of it),
    so the keys cover the whole depth range; names and values are drawn from ``seed``.
    """
    if not 1 <= keys <= len(KEY_NAMES):
        raise ValueError(f"keys must be in [1, {len(KEY_NAMES)}]")
    rng = random.Random(seed)
    names = tuple(rng.sample(KEY_NAMES, keys))
    answers = tuple(str(rng.randint(10000, 99999)) for _ in range(keys))
    depths = tuple((i + rng.uniform(0.1, 0.9)) / keys for i in range(keys))
    needles = [NEEDLE.format(name=n, value=v) for n, v in zip(names, answers, strict=True)]
    question = MultiKeyPrompt("", names, answers, depths).question(0)
    overhead = len(tokenizer.encode(INTRO + "".join(needles) + question, add_special_tokens=True))
    per_filler = len(tokenizer.encode(FILLER * 10, add_special_tokens=False)) / 10
    repeats = max(keys, int((target_tokens - overhead) / per_filler))
    parts, placed = [INTRO], 0
    for depth, needle in zip(depths, needles, strict=True):
        at = round(repeats * depth)
        parts += [FILLER * (at - placed), needle]
        placed = at
    parts.append(FILLER * (repeats - placed))
    return MultiKeyPrompt("".join(parts), names, answers, depths)
