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

Phases, in order, by group (each group's module describes its phases and runs alone):

| group    | module                        | phases                           |
|----------|-------------------------------|----------------------------------|
| auth     | bench/reliability/auth.py     | auth, tenants, logs              |
| fuzzing  | bench/reliability/fuzzing.py  | fuzz_http, fuzz_grpc             |
| overload | bench/reliability/overload.py | overload                         |
| faults   | bench/reliability/faults.py   | disconnect, corrupt, kill, redis |

The order: auth, tenants, fuzz_http, fuzz_grpc, disconnect, overload, corrupt, kill, redis,
then, with the service stopped, logs. In short: keys and tenants are enforced on every route,
hostile input gets only client errors, overload is shed with 429, and replica kills, Redis
crashes and wipes, corrupted blobs and cut streams lose no session.

Prints a table, writes reliability.json into --out, exits 1 when any check failed.
``--quick`` is the bounded version the tests run (a few minutes); the default is the long one.
``--phase NAME`` (repeatable) runs only those phases, in this order, with the sessions opened
before the first that needs them and verified at the end; a group's module runs its phases
the same way. The plumbing is bench/reliability/common.py, the runner bench/reliability/runner.py.

Usage: python bench/reliability/suite.py [--quick] [--out DIR] [--phase NAME ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness and this group

from reliability import auth, faults, fuzzing, overload
from reliability.runner import main

PHASES = [*auth.PHASES, *fuzzing.PHASES, *overload.PHASES, *faults.PHASES]

if __name__ == "__main__":
    sys.exit(main(PHASES, description=__doc__))
