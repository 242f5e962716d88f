"""Registered documents (``POST /v1/documents``): a tenant's shared texts in Redis, by id.

A document's id is a content address: a digest of the tenant and the text, so that the same
text registered twice by one tenant is one document, and one tenant's id names nothing for
another (the keys hold the tenant too: an id alone reaches nothing). The record holds the text
and its token count; the KV rows of its whole prefill chunks live in the replicas' shared
prefixes (engine/prefixes.py), which evict them under their budget like any other prefix and
compute them again from the text. A Redis wipe loses the records (the caller registers the
text again: 404 until then); sessions opened from a document hold their own copy of its text
in their logs, and go on.
"""

from __future__ import annotations

import hashlib
import time

from kvsnap.errors import NotFound, ResourceExhausted

from .directory import SessionDirectory
from .records import check_id


def document_id(tenant: str, text: str) -> str:
    """The id a tenant's text gets: "doc-" and 32 hex digits of a digest of both."""
    h = hashlib.blake2b(digest_size=16)
    name = tenant.encode()
    h.update(len(name).to_bytes(4, "little") + name + text.encode())
    return f"doc-{h.hexdigest()}"


class DocumentStore:
    """A tenant's documents: a hash per document, a set of the tenant's ids beside them."""

    def __init__(self, directory: SessionDirectory, limit: int = 1000):
        self.directory, self.limit = directory, limit
        self.client, self.prefix = directory.client, directory.prefix

    def key(self, tenant: str, doc_id: str) -> str:
        return f"{self.prefix}:d:{check_id('tenant', tenant)}:{check_id('document id', doc_id)}"

    def index_key(self, tenant: str) -> str:
        return f"{self.prefix}:ds:{check_id('tenant', tenant)}"

    def put(self, tenant: str, text: str, tokens: int) -> tuple[dict, bool]:
        """Register ``text`` (``tokens`` long); returns its record and whether it is new.
        ResourceExhausted past ``limit`` documents for the tenant (a known one is always fine)."""
        doc_id = document_id(tenant, text)
        known = self.get(tenant, doc_id)
        if known is not None:
            return known, False
        call = self.directory._call
        if call(self.client.scard, self.index_key(tenant)) >= self.limit:
            raise ResourceExhausted(f"the tenant holds {self.limit} documents, the limit; delete some first")
        record = {"document_id": doc_id, "tokens": tokens, "created": round(time.time(), 3)}
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(self.key(tenant, doc_id), mapping={**record, "text": text})
        pipe.sadd(self.index_key(tenant), doc_id)
        call(pipe.execute)
        return record, True

    def get(self, tenant: str, doc_id: str, text: bool = False) -> dict | None:
        raw = self.directory._call(self.client.hgetall, self.key(tenant, doc_id))
        if not raw:
            return None
        fields = {k.decode(): v.decode() for k, v in raw.items()}
        record = {"document_id": fields["document_id"], "tokens": int(fields["tokens"])}
        record["created"] = float(fields["created"])
        return record | ({"text": fields["text"]} if text else {})

    def require(self, tenant: str, doc_id: str, text: bool = False) -> dict:
        record = self.get(tenant, doc_id, text)
        if record is None:
            raise NotFound(f"document {doc_id!r} not found")
        return record

    def list(self, tenant: str) -> list[dict]:
        ids = sorted(m.decode() for m in self.directory._call(self.client.smembers, self.index_key(tenant)))
        found = (self.get(tenant, i) for i in ids)
        return [record for record in found if record is not None]

    def delete(self, tenant: str, doc_id: str) -> bool:
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self.key(tenant, doc_id))
        pipe.srem(self.index_key(tenant), doc_id)
        return bool(self.directory._call(pipe.execute)[0])
