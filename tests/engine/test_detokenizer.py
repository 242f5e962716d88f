"""Incremental detokenization: the same text as decoding every token at once, UTF-8 safe, cut at
the first stop string, and no delta ever hands out text that a stop string later takes back."""

from __future__ import annotations

import random

import pytest

from kvsnap.engine.detok import Detokenizer


def _decode_all(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=True)


def _feed(tokenizer, ids, stop=()):
    detok, deltas = Detokenizer(tokenizer, stop), []
    for token in ids:
        detok.add(token)
        deltas.append(detok.take())
        if detok.stopped:
            break
    deltas.append(detok.take(final=True))
    return detok, deltas


@pytest.mark.parametrize("seed", range(5))
def test_same_text_as_decoding_everything_at_once(tiny_engine, seed):
    tok = tiny_engine.tokenizer
    rng = random.Random(seed)
    ids = [rng.randrange(tiny_engine.vocab_size) for _ in range(200)]
    detok, deltas = _feed(tok, ids)
    assert detok.text == _decode_all(tok, ids) == "".join(deltas)
    assert not detok.stopped


def test_real_text_with_multibyte_characters(tiny_engine):
    tok = tiny_engine.tokenizer
    text = "Füchse jagen nachts 🦊 — « déjà vu » 東京 \n User: end"
    ids = tok.encode(text, add_special_tokens=False)
    detok, deltas = _feed(tok, ids)
    assert detok.text == _decode_all(tok, ids) == "".join(deltas)
    assert all("\ufffd" not in d for d in deltas)  # never half a character


def test_stop_string_cuts_and_is_never_handed_out(tiny_engine):
    tok = tiny_engine.tokenizer
    text = "The code is 48213.\nUser: What else?\nAssistant: nothing"
    ids = tok.encode(text, add_special_tokens=False)
    full = _decode_all(tok, ids)
    detok, deltas = _feed(tok, ids, stop=("\nUser:", "never"))
    assert detok.stopped and detok.text == full[: full.index("\nUser:")]
    assert "".join(deltas) == detok.text and not any("User" in d for d in deltas)
    # a stop string longer than one token, split across deltas, is held back until it is decided
    detok, deltas = _feed(tok, ids, stop=("48213.\nUser",))
    assert detok.text == full[: full.index("48213")] and "".join(deltas) == detok.text
