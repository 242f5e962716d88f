"""Synthetic long-context tasks generated locally (no downloads): the pass-key prompt.

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
