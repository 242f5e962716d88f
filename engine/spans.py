"""Sentence spans of a session's tokens, for policies that keep a span whole (``spans=True``).

A fact is a span of tokens: "The access code for the north gate is 65125." is fifteen tokens
for SmolLM2's tokenizer, which writes the five digits as five. A question attends to the
words it shares with the fact (the subject), seldom to the value after them, so a selection
by single rows keeps the subject and drops digits ("2222" for 22994). Rated by its span's
best row, a sentence is kept whole or not at all.

A span ends after a token whose text holds sentence punctuation or a line break, or after a
special token (a chat template's turn markers); one never runs past ``MAX_SPAN`` tokens, so a
text with no punctuation does not become one span that takes the whole budget.
"""

from __future__ import annotations

import re

import torch

MAX_SPAN = 48
ENDS = (".", "!", "?", ";", "\n")


def span_ends(tokenizer, vocab_size: int) -> bytes:
    """One byte a token id (``vocab_size`` of them): 1 for a token after which a span ends. A
    byte string, not a tensor: :func:`span_ids` reads it once a token, in a Python loop."""
    known = min(vocab_size, len(tokenizer)) if hasattr(tokenizer, "__len__") else vocab_size
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # a fast tokenizer's own batch, in Rust, of one-token ranges: ranges are no objects the
        # garbage collector tracks, where 49K one-item lists set off collections over a loaded
        # model's heap (0.27 s of the 0.5 s this took); 0.05 s for SmolLM2's vocabulary
        texts = backend.decode_batch([range(i, i + 1) for i in range(known)], skip_special_tokens=False)
    elif hasattr(tokenizer, "batch_decode"):  # (its clean-up of spaces moves no punctuation)
        texts = tokenizer.batch_decode([[i] for i in range(known)], skip_special_tokens=False)
    else:  # the tiny presets' byte tokenizer
        texts = [tokenizer.decode([i]) for i in range(known)]
    punctuation = re.compile("[" + re.escape("".join(ENDS)) + "]")
    ends = bytearray(vocab_size)
    ends[:known] = bytes(punctuation.search(text) is not None for text in texts)
    for special in getattr(tokenizer, "all_special_ids", None) or ():
        if 0 <= special < vocab_size:
            ends[special] = 1
    return bytes(ends)


def span_ids(ends: bytes, tokens: list[int], first: int = 0) -> torch.Tensor:
    """Ascending span ids ``[len(tokens)]`` of ``tokens`` (the first one ``first``): a new span
    starts after a token ``ends`` marks and after ``MAX_SPAN`` tokens of one span."""
    out, span, run, known = [], first, 0, len(ends)
    for token in tokens:
        out.append(span)
        run += 1
        if run == MAX_SPAN or (0 <= token < known and ends[token]):
            span, run = span + 1, 0
    return torch.tensor(out, dtype=torch.long)


def layer_spans(ends: bytes, old_rows: int, new_tokens: list[int]) -> torch.Tensor:
    """Spans of a layer's rows ``[old_rows + len(new_tokens)]``: rows kept from earlier turns
    (whose positions differ per head) are spans of one row each; this turn's rows by sentence."""
    return torch.cat([torch.arange(old_rows), span_ids(ends, new_tokens, first=old_rows)])
