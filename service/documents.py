"""Shared documents through the session API, for HTTP and gRPC alike.

``POST /v1/documents`` registers a text for the tenant (store/documents.py: a content address,
tenant-scoped) and has one replica prefill its whole prefill chunks into its shared prefixes
(engine/prefixes.py), routed like a new session on that text (to a replica holding its first
block, when one does). ``POST /v1/sessions`` with ``document_id`` opens a session on the
document's text: the same tokens as ``document`` with that text, so it starts from the shared
rows, and its cache, compression and answers are those of a session that prefilled it alone.
An OpenAI client reaches the same rows without an id: a chat whose prompt opens with the same
tokens starts from them (the prefix cache is keyed by tokens, not by id).

Deleting a document deletes its record; its rows in the replicas' prefix caches are shared by
content with any other prompt that opens the same way and age out under their budget.
"""

from __future__ import annotations

import asyncio

from kvsnap.errors import InvalidArgument, NotFound
from kvsnap.store.documents import DocumentStore, document_id

from .api import SessionAPI


class Documents:
    def __init__(self, api: SessionAPI, limit: int):
        self.api = api
        self.store = DocumentStore(api.directory, limit)

    async def add(self, tenant: str, text: str) -> dict:
        """Register ``text``; prefill its whole chunks on a replica. Returns the record with
        ``shared_tokens`` (held as shared rows on ``worker`` now) and ``created`` (new or known)."""
        _, tokens = self.api.document_tokens(text)  # a session's own tokens, checked before anything is stored
        record, created = await asyncio.to_thread(self.store.put, tenant, text, len(tokens))
        held = {"shared_tokens": 0, "worker": ""}
        if self.api.cfg.prefix_cache_mib:
            key = self.api.prefix_route(f"{tenant}/{record['document_id']}", tenant, tokens)
            held = await self.api._call("hold_prefix", key, tenant, tokens)
        return record | held | {"new": created}

    async def get(self, tenant: str, doc_id: str, text: bool = True) -> dict:
        return await asyncio.to_thread(self.store.require, tenant, doc_id, text)  # the store checks the id

    async def list(self, tenant: str) -> list[dict]:
        return await asyncio.to_thread(self.store.list, tenant)

    async def delete(self, tenant: str, doc_id: str) -> None:
        if not await asyncio.to_thread(self.store.delete, tenant, doc_id):
            raise NotFound(f"document {doc_id!r} not found")

    async def text_of(self, tenant: str, document: str | None, doc_id: str | None) -> str:
        """A new session's document: the text given, or the registered one ``doc_id`` names."""
        if bool(document) == bool(doc_id):
            raise InvalidArgument("give a document or a document_id (exactly one)")
        return document or (await self.get(tenant, doc_id))["text"]


__all__ = ["Documents", "document_id"]
