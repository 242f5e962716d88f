"""Incremental detokenization: the text of a growing answer, one token at a time, in constant
work per token, cut at the first stop string.

Decoding the whole answer again after every token is quadratic in its length. Here each new
token is decoded together with the few tokens before it (a window that starts at the last
point where the text was complete), and only the text past that point is new. A token that
ends inside a UTF-8 character (the decoder shows U+FFFD) waits for the next one. The result
is the same string as decoding every token at once (checked by tests on the real and the
tiny tokenizers).

Stop strings are searched only in the text near the end, and while a turn runs, the last
``len(longest stop) - 1`` characters are held back from the deltas: they may turn out to be
the start of a stop string, and text handed out cannot be taken back.
"""

from __future__ import annotations


class Detokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.text = ""  # the answer's text so far; once a stop string appears, the text before it
        self.stopped = False  # a stop string appeared
        self.matched = ""  # which one
        self._window = 0  # ids[_window:_done] decode to the end of ``text``: the context of new tokens
        self._done = 0
        self._emitted = 0  # characters of ``text`` handed out by take()
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    def add(self, token: int) -> None:
        """Append one generated token."""
        self.ids.append(token)
        if self.stopped:
            return
        before = self._decode(self.ids[self._window : self._done])
        after = self._decode(self.ids[self._window :])
        if after.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for the rest
            return
        new = after[len(before) :]
        self._window, self._done = self._done, len(self.ids)
        self._append(new)

    def take(self, final: bool = False) -> str:
        """The text not handed out yet; while the turn runs (``final`` False), without the last
        characters that could still begin a stop string. ``final``: the turn is over, so tokens
        still waiting to complete a character are decoded as they are."""
        if final:
            self.finish()
        end = len(self.text) if final or self.stopped else max(self._emitted, len(self.text) - self._hold)
        delta, self._emitted = self.text[self._emitted : end], end
        return delta

    def finish(self) -> None:
        """The answer is complete: tokens still waiting to complete a character join the text as
        they decode (as decoding the whole answer at once would show them)."""
        if not self.stopped and self._done < len(self.ids):
            before = self._decode(self.ids[self._window : self._done])
            after = self._decode(self.ids[self._window :])
            self._window, self._done = self._done, len(self.ids)
            self._append(after[len(before) :])

    def _append(self, new: str) -> None:
        start = max(0, len(self.text) - self._hold)  # a stop string may straddle old and new text
        self.text += new
        cuts = sorted((i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0)
        if cuts:
            self.text, self.stopped, self.matched = self.text[: cuts[0][0]], True, cuts[0][1]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
