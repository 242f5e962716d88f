"""The plain-text prompt template for models without a chat template (the embedded Gemma 3
270M is a base model). Documented in README; the same for the session and OpenAI APIs:

    system / document   "{content}\\n"
    user                "\\nUser: {content}\\nAssistant:"
    assistant           "{content}"            (what the model generated, verbatim)

Each message is tokenized on its own and the pieces concatenated, so a session's tokens
for messages 1..n are exactly a prefix of its tokens for messages 1..n+k: appending a
turn never re-tokenizes what the session already holds. A user message is tokenized as two
pieces, its turn marker and the rest: when the answer before it stopped on the marker (the
default stop string of templated turns), the session holds the marker already and the
worker skips it (``TurnRequest.marker``), so the session's tokens are still those of its
messages.
"""

from __future__ import annotations

from kvsnap.errors import InvalidArgument

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


def encode_messages(tokenizer, messages: list[dict], first: bool) -> list[int]:
    """Token ids of ``messages``; ``first`` adds the tokenizer's BOS (a session's first turn)."""
    ids: list[int] = []
    for i, message in enumerate(messages):
        text, bos = segment(message), first and i == 0
        if message["role"] == "user":  # the marker, then the rest (see the module docstring)
            ids += tokenizer.encode(TURN_MARKER, add_special_tokens=bos)
            text, bos = text[len(TURN_MARKER) :], False
        ids += tokenizer.encode(text, add_special_tokens=bos)
    return ids


def marker_ids(tokenizer) -> list[int]:
    """The turn marker's tokens, as a templated user message starts with them."""
    return list(tokenizer.encode(TURN_MARKER, add_special_tokens=False))
