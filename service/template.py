"""How chat messages become a session's tokens, the same for the session and OpenAI APIs.

A model whose tokenizer has a chat template (SmolLM2-135M-Instruct) uses it
(:class:`ChatTemplate`). A model without one (the embedded Gemma 3 270M is a base model)
gets kvsnap's plain-text template (:class:`PlainTemplate`, documented in README):

    system / document   "{content}\\n"
    user                "\\nUser: {content}\\nAssistant:"
    assistant           "{content}"            (what the model generated, verbatim)

Either way a session's tokens for messages 1..n are exactly a prefix of its tokens for
messages 1..n+k: appending a turn never re-tokenizes what the session already holds, and
only the new messages are prefilled.
"""

from __future__ import annotations

import logging
import weakref

from kvsnap.errors import InvalidArgument

log = logging.getLogger(__name__)

ROLES = ("system", "document", "user", "assistant")
# How the template starts a user's turn: a default stop string of templated turns (a base model
# would otherwise go on to write the next question itself). A request's own `stop` replaces it.
TURN_MARKER = "\nUser:"


def segment(message: dict) -> str:
    role, content = message.get("role"), message.get("content")
    if role not in ROLES:
        raise InvalidArgument(f"message role must be one of {ROLES}, got {role!r}")
    if not isinstance(content, str):
        raise InvalidArgument("message content must be a string")
    if role in ("system", "document"):
        return f"{content}\n"
    if role == "user":
        return f"{TURN_MARKER} {content}\nAssistant:"
    return content


class PlainTemplate:
    """kvsnap's plain-text template. Each message is tokenized on its own and the pieces
    concatenated. A user message is tokenized as two pieces, its turn marker and the rest: when
    the answer before it stopped on the marker (the default stop string of templated turns),
    the session holds the marker already and the worker skips it (``TurnRequest.marker``), so
    the session's tokens are still those of its messages."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.marker = list(tokenizer.encode(TURN_MARKER, add_special_tokens=False))
        self.stop = (TURN_MARKER,)  # a base model would otherwise write the next question itself

    def encode(self, messages: list[dict], first: bool) -> list[int]:
        """Token ids of ``messages``; ``first`` adds the tokenizer's BOS (a session's first turn)."""
        ids: list[int] = []
        for i, message in enumerate(messages):
            text, bos = segment(message), first and i == 0
            if message["role"] == "user":  # the marker, then the rest (see the class docstring)
                ids += self.tokenizer.encode(TURN_MARKER, add_special_tokens=bos)
                text, bos = text[len(TURN_MARKER) :], False
            ids += self.tokenizer.encode(text, add_special_tokens=bos)
        return ids


class ChatTemplate:
    """The model's own chat template, used append-only.

    A session holds its text up to the end of its last message's content: the model's answer
    stops on EOS (not kept) or its token limit, and a document opened alone has not been closed.
    A new turn's text is what the template renders for the conversation with the new messages,
    from that point on: the last message's closing tokens (``<|im_end|>\\n`` in ChatML), the new
    messages, the generation prompt. Rendered against a fixed probe conversation: the template
    is checked once to render append-only (earlier messages unchanged when one is added) and to
    close a document and an answer alike, so the text is the same whatever the session holds.
    A ``document`` message is rendered as a ``system`` one. The texts are tokenized as
    ``apply_chat_template`` does (no special tokens added); a piece starts with a special token
    (the closing one), so the pieces' tokens are those of the whole conversation. (An answer
    cut at a request's stop string is logged without it, but the session keeps the stop
    string's tokens as generated: the one place where its tokens differ from the template's.)
    A template that fails the check is not used: :func:`template_for` falls back to the plain
    template, with a warning.
    """

    marker: list[int] = []  # nothing to skip: an answer stops on EOS, which the session does not keep
    stop: tuple[str, ...] = ()

    _A, _B, _C = "kvsnap probe one", "kvsnap probe two", "kvsnap probe three"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.context = [{"role": "user", "content": self._A}, {"role": "assistant", "content": self._B}]
        closed, self.close = self._held()
        document = self._render([{"role": "system", "content": self._A}], gen=False)
        appended = self._render([*self.context, {"role": "user", "content": self._C}], gen=True)
        if not self.close or not document.endswith(self._A + self.close) or not appended.startswith(closed):
            raise InvalidArgument(
                "the model's chat template does not render conversations append-only (or closes a "
                "system message and an answer differently); kvsnap cannot resume its sessions"
            )

    def _held(self) -> tuple[str, str]:
        """The probe conversation rendered (what a session holds after an answer, then the
        answer's closing text), anew each time: a template may render the date, for one."""
        closed = self._render(self.context, gen=False)
        if self._B not in closed:  # a template that drops past answers: not append-only
            raise InvalidArgument("the model's chat template does not render past answers")
        close = closed[closed.rindex(self._B) + len(self._B) :]
        return closed[: len(closed) - len(close)], close

    def _render(self, messages: list[dict], gen: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        except Exception as exc:  # noqa: BLE001 - jinja's TemplateError and what the template raises
            raise InvalidArgument(f"the model's chat template refused these messages: {exc}") from exc

    def encode(self, messages: list[dict], first: bool) -> list[int]:
        """Token ids of ``messages``: the whole conversation's (``first``), else the text that
        follows what a session holds, up to the generation prompt (last message from the user)
        or the end of the last message's content."""
        mapped = []
        for message in messages:
            segment(message)  # role and content checked as for the plain template
            role = "system" if message["role"] == "document" else message["role"]
            mapped.append({"role": role, "content": message["content"]})
        gen = mapped[-1]["role"] == "user"
        if first:
            text = self._render(mapped, gen)
        else:
            held, _ = self._held()
            full = self._render([*self.context, *mapped], gen)
            if not full.startswith(held):
                raise InvalidArgument("the model's chat template does not extend this conversation append-only")
            text = full[len(held) :]
        if not gen:  # left open: the next turn's text starts by closing it
            if not text.endswith(self.close):
                raise InvalidArgument("the model's chat template does not close this message as expected")
            text = text[: len(text) - len(self.close)]
        return list(self.tokenizer.encode(text, add_special_tokens=False))


_TEMPLATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def template_for(tokenizer) -> PlainTemplate | ChatTemplate:
    """The tokenizer's chat template where it has one that renders append-only, else the plain
    template (built once per tokenizer)."""
    template = _TEMPLATES.get(tokenizer)
    if template is None:
        template = PlainTemplate(tokenizer)
        if getattr(tokenizer, "chat_template", None):
            try:
                template = ChatTemplate(tokenizer)
            except InvalidArgument as exc:
                log.warning("%s: using kvsnap's plain template instead", exc)
        _TEMPLATES[tokenizer] = template
    return template


def encode_messages(tokenizer, messages: list[dict], first: bool) -> list[int]:
    """Token ids of ``messages`` under the tokenizer's template (see the module docstring)."""
    return template_for(tokenizer).encode(messages, first)
