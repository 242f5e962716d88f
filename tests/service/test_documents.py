"""Registered documents through the real service (HTTP and gRPC): POST /v1/documents prefills a
text's whole chunks once, sessions opened with its document_id start from those rows and answer
like a session that prefilled the text alone, and a tenant reaches only its own documents."""

from __future__ import annotations

import uuid

import grpc
import pytest
import requests

from kvsnap.service.grpc_stubs import pb2, pb2_grpc

from .test_shared_prefixes import DOCUMENT


def post(service, path: str, body: dict, key: str = "key-alpha"):
    return requests.post(f"{service.http}{path}", json=body, headers=service.headers(key), timeout=120)


def get(service, path: str, key: str = "key-alpha"):
    return requests.get(f"{service.http}{path}", headers=service.headers(key), timeout=30)


def ask(service, sid: str, key: str = "key-alpha") -> dict:
    r = post(service, f"/v1/sessions/{sid}/turns", {"message": "Which crate weighs 14 kg?", "max_tokens": 6}, key)
    assert r.status_code == 200, r.text
    return r.json()


def test_sessions_on_a_registered_document_start_from_its_rows(service):
    text = f"Invoice {uuid.uuid4().hex}. {DOCUMENT}"  # its first chunk new to the service
    doc = post(service, "/v1/documents", {"document": text})
    assert doc.status_code == 201, doc.text
    info = doc.json()
    assert info["document_id"].startswith("doc-") and info["new"] and info["tokens"] > 1024
    assert info["shared_tokens"] == 1024 and info["worker"]  # its whole chunk, held on that replica
    again = post(service, "/v1/documents", {"document": text}).json()  # the same text: the same document
    assert again["document_id"] == info["document_id"] and not again["new"] and again["shared_tokens"] == 1024
    opened = post(service, "/v1/sessions", {"document_id": info["document_id"]})
    assert opened.status_code == 201, opened.text
    assert opened.json()["cached_tokens"] == 1024 and opened.json()["logical_len"] == info["tokens"]
    answer = ask(service, opened.json()["session_id"])
    assert answer["worker"] == info["worker"]  # routed to the replica holding the document
    # another tenant opens a session on the very same text, prefilled alone: the same session
    alone = post(service, "/v1/sessions", {"document": text}, key="key-beta")
    assert alone.status_code == 201 and alone.json()["cached_tokens"] == 0
    assert alone.json()["kept_len"] == opened.json()["kept_len"]
    assert ask(service, alone.json()["session_id"], key="key-beta")["text"] == answer["text"]
    listed = get(service, "/v1/documents").json()["documents"]
    assert info["document_id"] in [d["document_id"] for d in listed] and all("text" not in d for d in listed)
    assert get(service, f"/v1/documents/{info['document_id']}").json()["text"] == text


def test_a_tenant_reaches_only_its_own_documents(service):
    text = f"Contract {uuid.uuid4().hex}. {DOCUMENT}"
    doc_id = post(service, "/v1/documents", {"document": text}).json()["document_id"]
    path = f"/v1/documents/{doc_id}"
    assert get(service, path, key="key-beta").status_code == 404  # by id
    assert post(service, "/v1/sessions", {"document_id": doc_id}, key="key-beta").status_code == 404
    assert requests.delete(f"{service.http}{path}", headers=service.headers("key-beta"), timeout=30).status_code == 404
    assert doc_id not in [d["document_id"] for d in get(service, "/v1/documents", key="key-beta").json()["documents"]]
    theirs = post(service, "/v1/documents", {"document": text}, key="key-beta").json()  # by content
    assert theirs["document_id"] != doc_id and theirs["new"]
    assert get(service, path).status_code == 200  # alpha's is untouched
    # deleted: gone for its tenant, while a session opened from it goes on
    sid = post(service, "/v1/sessions", {"document_id": doc_id}).json()["session_id"]
    assert requests.delete(f"{service.http}{path}", headers=service.headers(), timeout=30).status_code == 204
    assert get(service, path).status_code == 404
    assert post(service, "/v1/sessions", {"document_id": doc_id}).status_code == 404
    assert ask(service, sid)["text"]


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"document": ""}, 400),
        ({"document": "x", "extra": 1}, 400),
        ({"document": "x" * 4000}, 413),  # past max_prompt_tokens (3,000)
        ({}, 400),
    ],
)
def test_bad_documents_are_refused_before_any_work(service, body, status):
    before = len(get(service, "/v1/documents").json()["documents"])
    r = post(service, "/v1/documents", body)
    assert r.status_code == status, r.text
    assert len(get(service, "/v1/documents").json()["documents"]) == before  # nothing stored


@pytest.mark.parametrize(
    "body",
    [{}, {"document": "a text", "document_id": "doc-0"}, {"document_id": "bad id!"}],
)
def test_a_session_names_a_document_or_a_document_id(service, body):
    r = post(service, "/v1/sessions", body)
    assert r.status_code == 400, r.text
    assert post(service, "/v1/sessions", {"document_id": f"doc-{'0' * 32}"}).status_code == 404


def test_documents_over_grpc(service):
    stub = pb2_grpc.KvsnapStub(grpc.insecure_channel(service.grpc))
    alpha, beta = [("authorization", "Bearer key-alpha")], [("authorization", "Bearer key-beta")]
    text = f"Bill {uuid.uuid4().hex}. {DOCUMENT}"
    doc = stub.CreateDocument(pb2.CreateDocumentRequest(document=text), metadata=alpha)
    assert doc.new and doc.shared_tokens == 1024 and doc.tokens > 1024
    assert stub.GetDocument(pb2.DocumentRef(document_id=doc.document_id), metadata=alpha).text == text
    listed = stub.ListDocuments(pb2.ListDocumentsRequest(), metadata=alpha).documents
    assert doc.document_id in [d.document_id for d in listed]
    state = stub.CreateSession(pb2.CreateSessionRequest(document_id=doc.document_id), metadata=alpha)
    assert state.logical_len == doc.tokens
    with pytest.raises(grpc.RpcError) as err:
        stub.GetDocument(pb2.DocumentRef(document_id=doc.document_id), metadata=beta)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        stub.CreateSession(pb2.CreateSessionRequest(document="x", document_id=doc.document_id), metadata=alpha)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert stub.DeleteDocument(pb2.DocumentRef(document_id=doc.document_id), metadata=alpha).deleted
    with pytest.raises(grpc.RpcError) as err:
        stub.GetDocument(pb2.DocumentRef(document_id=doc.document_id), metadata=alpha)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_the_document_store_keeps_a_tenants_texts_apart_and_to_its_limit(directory_factory):
    from kvsnap.errors import ResourceExhausted
    from kvsnap.store.documents import DocumentStore

    store = DocumentStore(directory_factory(), limit=2)
    first, new = store.put("alpha", "text one", 3)
    assert new and store.put("alpha", "text one", 3) == (first, False)  # idempotent: a content address
    assert store.put("beta", "text one", 3)[0]["document_id"] != first["document_id"]
    store.put("alpha", "text two", 3)
    with pytest.raises(ResourceExhausted):
        store.put("alpha", "text three", 3)
    assert store.put("alpha", "text two", 3)[1] is False  # a known one is always fine
    assert store.get("beta", first["document_id"]) is None
    assert [d["document_id"] for d in store.list("alpha")] == sorted(
        d["document_id"] for d in (first, store.put("alpha", "text two", 3)[0])
    )
    assert store.delete("alpha", first["document_id"]) and not store.delete("alpha", first["document_id"])
    assert store.get("alpha", first["document_id"], text=True) is None and len(store.list("alpha")) == 1
