"""A policy is one file: this one is written here, registered in one call, and used over HTTP and
gRPC with its own parameter, without a line of service/ changed. The shared service loads this
module in every replica through its ``policy_modules`` setting (tests/conftest.py), as an
operator would load a module of their own (KVSNAP_POLICY_MODULES)."""

from __future__ import annotations

from dataclasses import dataclass

import requests
import torch

from kvsnap.errors import InvalidArgument
from kvsnap.policies import Policy, register_policy


@register_policy
@dataclass(frozen=True, slots=True)
class KeepEvery(Policy):
    """Keep every ``stride``-th prefix row (the earliest first) and the observation window."""

    name = "keep_every"
    stride: int = 2

    def __post_init__(self) -> None:
        Policy.__post_init__(self)
        if isinstance(self.stride, bool) or not isinstance(self.stride, int) or self.stride < 1:
            raise InvalidArgument(f"stride must be an integer >= 1, got {self.stride!r}")

    def score(self, window_queries: torch.Tensor, keys: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        batch, kv_heads, length, _ = keys.shape
        prefix = torch.arange(length - window_queries.shape[-2], device=keys.device)
        hit = (prefix % self.stride == 0).float()
        return (hit - prefix / length).expand(batch, kv_heads, -1)  # [B, H_kv, L - w]: strided rows, earliest first


DOC = "Foxes are small omnivorous mammals. The pass key is 48213. Foxes live in dens. " * 4


def test_a_policy_written_in_a_test_file_serves_over_http(service):
    settings = {"policy": "keep_every", "stride": 3, "budget": 10, "window": 4}
    made = requests.post(
        f"{service.http}/v1/sessions",
        headers=service.headers(),
        json={"session_id": "plugin-http", "document": DOC, "settings": settings},
    )
    assert made.status_code == 201, made.text
    state = made.json()
    assert state["policy"].startswith("keep_every(") and "stride=3" in state["policy"]
    assert state["kept_len"] == 10 + 4 < state["logical_len"]  # budget + window rows: it really compressed
    answer = requests.post(
        f"{service.http}/v1/sessions/plugin-http/turns",
        headers=service.headers(),
        json={"message": "What is the pass key?", "max_tokens": 4},
    )
    assert answer.status_code == 200 and answer.json()["state"]["turns"] == 2, answer.text


def test_its_parameters_are_checked_like_a_built_in_policys(service):
    def create(settings):
        return requests.post(
            f"{service.http}/v1/sessions",
            headers=service.headers(),
            json={"session_id": "plugin-bad", "document": DOC, "settings": settings},
        )

    bad = create({"policy": "keep_every", "stride": 0})
    assert bad.status_code == 400 and "stride must be an integer >= 1" in bad.text
    unknown = create({"policy": "keep_every", "strides": 2})
    assert unknown.status_code == 400 and "stride" in unknown.json()["error"]["message"]
    listed = create({"policy": "no_such_policy"})
    assert listed.status_code == 400 and "keep_every" in listed.json()["error"]["message"]


def test_its_parameters_ride_over_grpc_too(service):
    import grpc

    from kvsnap.service.grpc_stubs import pb2, pb2_grpc

    stub = pb2_grpc.KvsnapStub(grpc.insecure_channel(service.grpc))
    settings = pb2.SessionSettings(policy="keep_every", budget=10, window=4, params={"stride": "5"})
    state = stub.CreateSession(
        pb2.CreateSessionRequest(session_id="plugin-grpc", document=DOC, settings=settings),
        metadata=[("authorization", "Bearer key-alpha")],
    )
    assert "stride=5" in state.policy and state.kept_len == 14


def test_the_protos_explicit_fields_are_the_policies_own():
    """The proto keeps explicit fields for the built-in policies' parameters; each must be one of
    a policy's dataclass fields, of the same type (everything else rides in ``params``)."""
    from google.protobuf.descriptor import FieldDescriptor

    from kvsnap.policies import POLICIES, evictor_names, policy_params
    from kvsnap.service.grpc_stubs import pb2

    kinds = {FieldDescriptor.TYPE_INT32: int, FieldDescriptor.TYPE_STRING: str, FieldDescriptor.TYPE_FLOAT: float}
    for message, names in ((pb2.SessionSettings, sorted(POLICIES)), (pb2.DecodeSettings, evictor_names())):
        params: dict[str, type] = {}
        for name in names:
            params |= policy_params(name)
        explicit = [f for f in message.DESCRIPTOR.fields if f.name not in ("policy", "recompress", "decode", "params")]
        assert explicit
        for field in explicit:
            assert params.get(field.name) is kinds[field.type], (message.DESCRIPTOR.name, field.name)
