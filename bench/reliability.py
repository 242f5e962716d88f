"""Reliability and security suite: faults, overload and hostile input against a real local
service, with nothing lost.

One local Ray, one redis-server (started here, so that this script can crash, restart and
wipe it) and one Serve app: tiny-llama, 2 worker replicas, a device and a host tier of 1 MiB
each and a disk tier, so sessions spread over all three. Half the sessions use the service's
default policy, SnapKV (budget 128, window 16: their caches really are compressed), half policy
``full``; all decode greedily, so an uninterrupted in-process twin tells exactly what each turn
must answer (a rebuild replays each turn's compression, so a SnapKV session rebuilt after a
kill, a wipe or a corrupted blob must answer like its twin too). After every disruptive phase
each session is asked its next question and must answer that (a session that cannot is
*lost*); the figures count each policy apart.

Phases, in order:

- auth:        every route and method without a key and with a wrong one: 401 / UNAUTHENTICATED
               (health exempt); admin routes with a tenant's key: 403, with the admin key and an
               unknown worker id: 404, and no replica drained.
- tenants:     another tenant reads, continues and deletes a session by every route and
               method: answered exactly like a missing id; the session is unchanged.
- fuzz_http:   schemathesis over the whole OpenAPI schema: no 5xx.
- fuzz_grpc:   malformed bytes, truncated, oversized and hostile-valued messages to every
               method: only client-error statuses (never INTERNAL / UNKNOWN / UNAVAILABLE).
- disconnect:  streamed turns cut after their first token: the session answers its next turn.
- overload:    twice the service's capacity in concurrent turns: excess answered 429 with
               Retry-After, accepted turns within their timeout, tiers within their budgets,
               no replica lost, and a turn right after answers.
- corrupt:     the disk tier's session files truncated or garbled: detected, rebuilt from the
               token log, right answers.
- kill:        a worker replica killed every few seconds while the sessions converse: every
               turn succeeds or fails with a retryable 503 / 429, none past its timeout.
- redis:       redis-server crashed (SIGKILL) mid-load and restarted over its data, then
               restarted empty: requests fail fast with 503 while it is down; afterwards the
               workers re-register what they hold and no session is lost.
- logs:        no API key appears in any log (Ray's, Redis's, the app's).

Prints a table, writes reliability.json into --out, exits 1 when any check failed.
``--quick`` is the bounded version the tests run (a few minutes); the default is the long one.
``--phase NAME`` (repeatable) runs only those phases, in this order, with the sessions opened
before the first that needs them and verified at the end. The phases live in four groups,
each runnable alone the same way: bench/reliability_auth.py (auth, tenants, logs),
reliability_fuzzing.py (fuzz_http, fuzz_grpc), reliability_overload.py (overload) and
reliability_faults.py (disconnect, corrupt, kill, redis); the plumbing is reliability_common.py.

Usage: python bench/reliability.py [--quick] [--out DIR] [--phase NAME ...]
"""

from __future__ import annotations

import sys

import reliability_auth
import reliability_faults
import reliability_fuzzing
import reliability_overload
from reliability_runner import main

PHASES = [
    *reliability_auth.PHASES,
    *reliability_fuzzing.PHASES,
    *reliability_overload.PHASES,
    *reliability_faults.PHASES,
]

if __name__ == "__main__":
    sys.exit(main(PHASES, description=__doc__))
