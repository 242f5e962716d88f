"""Implicit sessions: after a commit, the session's content (conversation or raw text) is
recorded in the directory, so that a request without a session id that repeats it and adds
more resumes the session (the digests themselves: store/conversations.py)."""

from __future__ import annotations

import logging

from kvsnap.store.directory import SessionDirectory, SessionEntry

log = logging.getLogger(__name__)


def record_conversation(directory: SessionDirectory, key: str, entry: SessionEntry, messages: list[dict]) -> None:
    """Record the implicit session ``entry`` as holding ``messages`` (a hint: a failure is
    logged, never raised, as the turn is committed already)."""
    try:
        directory.register_conversation(entry.tenant, entry.conversation, entry.session_id, messages)
    except Exception as exc:  # noqa: BLE001 - the turn is committed already
        log.warning("conversation of %s not recorded: %s", key, exc)
