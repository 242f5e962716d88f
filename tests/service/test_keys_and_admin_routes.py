"""Admin keys and the admin routes: a tenant's key, no key or an unknown key is refused, only real
worker ids are drained, and the routes are off where no admin key is configured. (After
test_affinity_and_moves.py, whose drain has ended by then: this file checks nothing is draining.)"""

from __future__ import annotations

import pytest
import requests

from kvsnap.errors import InvalidArgument, PermissionDenied, Unauthenticated
from kvsnap.service.config import ServiceConfig
from kvsnap.store.directory import SessionDirectory

from ..conftest import ADMIN_KEY
from .helpers import FULL, QUESTIONS, create, turn


def test_admin_routes_take_admin_keys_and_real_worker_ids_only(service):
    assert create(service, "admin-probe", FULL).status_code == 201
    holder = turn(service, "admin-probe", QUESTIONS[0]).json()["worker"]
    url = f"{service.http}/v1/admin/workers/{holder}/drain"
    denied = requests.post(url, headers=service.headers("key-alpha"))
    assert denied.status_code == 403 and denied.json()["error"]["type"] == "permission_denied"
    assert requests.post(url, headers=service.headers("key-beta")).status_code == 403
    assert requests.post(url).status_code == 401
    assert requests.post(url, headers=service.headers("no-such-key")).status_code == 401
    for bogus in ("0", "w0", "worker-0", "any", holder + "x"):
        missing = requests.post(f"{service.http}/v1/admin/workers/{bogus}/drain", headers=service.headers(ADMIN_KEY))
        assert missing.status_code == 404, (bogus, missing.text)
    bad = requests.post(url, params={"resume_after_s": -1}, headers=service.headers(ADMIN_KEY))
    assert bad.status_code == 400
    # nothing was drained: every replica takes turns, the session stays on its holder's device tier
    assert not any(load["draining"] for load in SessionDirectory(service.redis_url).loads().values())
    again = turn(service, "admin-probe", QUESTIONS[1]).json()
    assert again["worker"] == holder and again["source"] == "device"


def test_admin_routes_are_off_without_admin_keys():
    from kvsnap.service.auth import check_admin

    off = ServiceConfig(api_keys={"k": "t"})
    with pytest.raises(PermissionDenied, match="no admin key is configured"):
        check_admin(off, "Bearer k")
    on = ServiceConfig(api_keys={"k": "t"}, admin_keys="a1, a2")
    assert on.admin_keys == ["a1", "a2"] and check_admin(on, "Bearer a2")
    with pytest.raises(PermissionDenied):
        check_admin(on, "Bearer k")
    with pytest.raises(Unauthenticated):
        check_admin(on, "Bearer zz")
    with pytest.raises(InvalidArgument, match="admin key must not also be"):
        ServiceConfig.from_env(api_keys={"k": "t"}, admin_keys=["k"])
