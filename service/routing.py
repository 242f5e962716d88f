"""Cache-affinity routing: a turn of session S goes to the replica that holds S's KV.

A Ray Serve request router (configured on the worker deployment). The ingress tags
every call with ``session_id = "<tenant>/<session>"`` (handle option); the router
asks Redis who holds that session and returns only that replica, so Serve's own
retry can never send the turn to a replica without the cache. When the holder is
gone, draining, or has ``overload_queue_len`` requests in flight, or for a new
session, it ranks the replicas by KV bytes held, then queue length (least loaded
first); the replica that gets the turn then imports or rebuilds the KV (a move,
counted by the worker). ``session_id = "worker:<id>"`` addresses one replica
(admin calls such as drain).

A new session whose prompt holds a whole prefill chunk comes tagged
``"<tenant>/<session>#<first block>"`` (service/api.py): the replicas that hold that block
as a shared prefix come first, least loaded first, unless overloaded or draining; the others
follow by load. A replica holds it by the directory in Redis (store/prefix_holders.py: each
worker reports its shared prefixes with its heartbeat and after prefilling a registered
document), by its routing stats (engine/prefixes.py roots; they lag by a second), or because
this router last sent a session with it there. The holders' lookup is a second round trip
for such a session, bounded by ``HOLDERS_TIMEOUT_S``.

When Redis does not answer in time (a busy machine: the lookup runs on the ingress's event
loop), the router sends the turn where it last saw the session go: the owner Redis last
named, or the replica this router last routed one of the session's calls to (its open too,
whose holder Redis cannot name before that open commits), never away by load alone.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import OrderedDict, deque

import redis.asyncio as aioredis
from ray.serve.request_router import RequestRouter

from kvsnap.store.directory import owner_of
from kvsnap.store.prefix_holders import holders_of

log = logging.getLogger(__name__)
PLACEMENT_MEMORY_S = 2.0  # > the routing-stats period (1 s)
HOLDERS_TIMEOUT_S = 0.5  # the prefix holders' lookup, a hint: past this a new session is placed without it
OWNER_CACHE_SIZE = 100_000


class AffinityRouter(RequestRouter):
    # No FIFOMixin: FIFO would hand the replica chosen for one session's turn to whichever
    # request is oldest. The base class fulfils exactly the request that was routed.
    def initialize_state(
        self,
        redis_url: str = "",
        prefix: str = "kvsnap",
        overload_queue_len: int = 8,
        affinity: bool = True,
        holder_ttl_s: int = 10,
        **_,
    ):
        self.redis = aioredis.Redis.from_url(redis_url, socket_timeout=5.0, socket_connect_timeout=2.0)
        # Last owner seen per session (read from Redis, or where this router routed the session's
        # last call): under heavy load a Redis answer can be slow, and a failed lookup must not
        # send a turn away from its cache, a session's first follow-up included.
        self._owners: OrderedDict[str, str] = OrderedDict()
        self.prefix = prefix
        self.overload_queue_len = overload_queue_len
        self.affinity = affinity  # False: plain round-robin, the baseline the benchmark compares against
        # Routing stats lag by up to a second: sessions placed since then count as load too.
        self._placed: dict[str, deque[float]] = {}
        self._roots: OrderedDict[str, str] = OrderedDict()  # a shared prefix's first block -> last replica sent
        self.holder_ttl_s = holder_ttl_s  # a worker's report of a shared prefix holds this long (its heartbeat TTL)

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if pending_request is None or not candidate_replicas:
            return [candidate_replicas]
        pending_request.routing_context.should_backoff = True
        key, _, root = (pending_request.metadata.session_id or "").partition("#")
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}

        if key.startswith("worker:"):  # an admin call for one replica
            target = by_id.get(key[len("worker:") :])
            return [[target]] if target else [candidate_replicas]

        if not self.affinity:  # the baseline: spread requests in rotation from a random start, so that
            # turns cannot line up with where sessions were placed (a strict rotation did, now and then)
            ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
            start = random.randrange(len(ordered))
            return [[ordered[(start + i) % len(ordered)]] for i in range(len(ordered))]

        if "/" in key:
            holder = by_id.get(await self._owner(key))
            if holder is not None and not self._unfit(holder):
                return [[holder]]

        pending_request.routing_context.placing = True  # read back in on_request_routed
        live = [r for r in candidate_replicas if not self._draining(r)]
        random.shuffle(live)  # equal loads: no replica is always first
        ranked = sorted(live, key=self._load(live))
        if root:  # a new session on a shared prefix: its holders first
            holders = await self._holders(root)
            ranked.sort(key=lambda r: not self._holds(r, root, holders) or self._unfit(r))  # stable: by load within
        return [[r] for r in ranked] or [candidate_replicas]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        key, _, root = (pending_request.metadata.session_id or "").partition("#")
        if self.affinity and "/" in key:  # where the session's KV will be once this call commits
            self._remember(self._owners, key, replica_id.unique_id)
        if self.affinity and root:  # where that prefix will be once this session's prefill runs
            self._remember(self._roots, root, replica_id.unique_id)
        if getattr(pending_request.routing_context, "placing", False):
            self._placed.setdefault(replica_id.unique_id, deque()).append(time.monotonic())

    def _holds(self, replica, root: str, holders: set[str]) -> bool:
        """Whether ``replica`` holds the shared prefix whose first block is ``root``: by the
        directory's ``holders``, its last routing stats, or where this router last sent a session with it."""
        rid = replica.replica_id.unique_id
        if rid in holders or self._roots.get(root) == rid:
            return True
        return root in ((replica.routing_stats or {}).get("prefix_roots") or ())

    async def _holders(self, root: str) -> set[str]:
        """The workers the directory names as holding ``root``; none when Redis does not answer
        within ``HOLDERS_TIMEOUT_S`` (a hint: the stats and this router's memory still route,
        and a new session is never held up for it)."""
        try:
            lookup = holders_of(self.redis, self.prefix, root, self.holder_ttl_s)
            return await asyncio.wait_for(lookup, HOLDERS_TIMEOUT_S)
        except Exception as exc:
            log.warning("affinity router: prefix holders lookup failed (%r)", exc)
            return set()

    async def _owner(self, key: str) -> str:
        tenant, _, session_id = key.partition("/")
        try:
            owner = await owner_of(self.redis, self.prefix, tenant, session_id)
        except Exception as exc:  # Redis slow or down: the last owner seen, else route by load
            log.warning("affinity router: owner lookup failed (%s); using the last known owner", exc)
            return self._owners.get(key, "")
        if owner:  # none yet (a session being opened): keep where its open was routed
            self._remember(self._owners, key, owner)
        return owner

    @staticmethod
    def _remember(memory: OrderedDict, key: str, owner: str) -> None:
        memory[key] = owner
        memory.move_to_end(key)
        while len(memory) > OWNER_CACHE_SIZE:
            memory.popitem(last=False)

    def _queue_len(self, replica) -> int:
        cached = self.replica_queue_len_cache.get(replica.replica_id)
        stats = replica.routing_stats or {}
        return max(cached or 0, int(stats.get("ongoing", 0)))

    @staticmethod
    def _draining(replica) -> bool:
        return bool((replica.routing_stats or {}).get("draining"))

    def _unfit(self, replica) -> bool:
        """Draining, or with ``overload_queue_len`` requests in flight by this router's count or
        the replica's last report (no extra round trip on the hot path). A dead holder is
        dropped from the candidates by Serve; until then its turns fail and are retried."""
        return self._draining(replica) or self._queue_len(replica) >= self.overload_queue_len

    def _load(self, replicas):
        """Sort key: KV bytes held (plus a typical session per recent placement), then queue length."""
        stats = [r.routing_stats or {} for r in replicas]
        sessions = sum(int(s.get("sessions", 0)) for s in stats)
        per_session = sum(int(s.get("kv_bytes", 0)) for s in stats) / sessions if sessions else 1.0
        now = time.monotonic()

        def key(replica):
            placed = self._placed.get(replica.replica_id.unique_id, deque())
            while placed and now - placed[0] > PLACEMENT_MEMORY_S:
                placed.popleft()
            kv_bytes = int((replica.routing_stats or {}).get("kv_bytes", 0))
            return kv_bytes + len(placed) * per_session, self._queue_len(replica)

        return key
