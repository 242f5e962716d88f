"""Locust file for the kvsnap HTTP session API, for those who load-test with Locust.

Each simulated user opens a session with its own synthetic document, then keeps asking
follow-up questions on it (the RAG pattern). Settings come from the environment:

    KVSNAP_API_KEY        API key (required)
    KVSNAP_LOAD_CONTEXT   document length in words (default 1500, about 2K tokens on Gemma)
    KVSNAP_LOAD_TOKENS    tokens generated per turn (default 16)
    KVSNAP_LOAD_POLICY    session policy (default: the service's)

    pip install locust
    KVSNAP_API_KEY=... locust -f bench/service/locustfile.py --host http://127.0.0.1:8000 \\
        --headless -u 8 -r 2 -t 2m

A turn's name in the statistics is ``turn``; a document upload is ``open``. ``kvsnap load``
(the built-in generator) measures time to first token as well; Locust times whole requests.
"""

from __future__ import annotations

import os
import uuid

from locust import HttpUser, between, task

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


class RagUser(HttpUser):
    wait_time = between(0.5, 2.0)

    def on_start(self) -> None:
        key = os.environ.get("KVSNAP_API_KEY")
        if not key:
            raise RuntimeError("set KVSNAP_API_KEY")
        self.client.headers["Authorization"] = f"Bearer {key}"
        words = int(os.environ.get("KVSNAP_LOAD_CONTEXT", "1500"))
        settings = {"policy": os.environ["KVSNAP_LOAD_POLICY"]} if os.environ.get("KVSNAP_LOAD_POLICY") else {}
        self.session_id = f"locust-{uuid.uuid4().hex[:12]}"
        document = f"Document {self.session_id}. " + FILLER * max(1, words // 19)
        with self.client.post(
            "/v1/sessions",
            json={"session_id": self.session_id, "document": document, "settings": settings},
            name="open",
            catch_response=True,
        ) as r:
            if r.status_code != 201:
                r.failure(f"{r.status_code}: {r.text[:200]}")
        self.asked = 0

    @task
    def follow_up(self) -> None:
        self.asked += 1
        with self.client.post(
            f"/v1/sessions/{self.session_id}/turns",
            json={
                "message": f"Question {self.asked}: what is this document about?",
                "max_tokens": int(os.environ.get("KVSNAP_LOAD_TOKENS", "16")),
            },
            name="turn",
            catch_response=True,
        ) as r:
            if r.status_code != 200:
                r.failure(f"{r.status_code}: {r.text[:200]}")

    def on_stop(self) -> None:
        self.client.delete(f"/v1/sessions/{self.session_id}", name="delete")
