"""Which workers hold which shared prefix: the directory's record the router reads, so a new
session whose prompt opens with a known document goes to a replica that holds its blocks.

A shared prefix is named by its first block's digest (engine/prefixes.py ``root_key``: the
tenant, and the tokens of the prompt's first ``route_tokens``); a name tells nothing of the
text, and one tenant's text never makes another tenant's name. Per name, a sorted set of the
workers that reported holding it, each scored by the Redis server's clock when it last did
(so workers' and routers' clocks need not agree). A worker reports what it holds with every
heartbeat and right after it prefills a registered document; a name it stopped reporting
(its blocks evicted, the worker gone) drops out after ``heartbeat_ttl_s``. The router reads
this besides the replicas' routing stats (which lag by a second and come from the replicas
it sees) and where it last sent a session on that document (its own sends only).
"""

from __future__ import annotations

# KEYS: one sorted set per prefix name. ARGV: worker id, TTL in seconds. Scored by server time.
PUBLISH = """
local now = tonumber(redis.call('TIME')[1])
for i = 1, #KEYS do
  redis.call('ZADD', KEYS[i], now, ARGV[1])
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now - tonumber(ARGV[2]))
  redis.call('EXPIRE', KEYS[i], ARGV[2])
end
return #KEYS
"""

# KEYS: one prefix name's set. ARGV: TTL in seconds. The workers that reported it within the TTL.
HOLDERS = """
local now = tonumber(redis.call('TIME')[1])
return redis.call('ZRANGEBYSCORE', KEYS[1], now - tonumber(ARGV[1]), '+inf')
"""


def holders_key(prefix: str, root: str) -> str:
    return f"{prefix}:p:{root}"


async def holders_of(aclient, prefix: str, root: str, ttl_s: int) -> set[str]:
    """The workers that reported holding the shared prefix named ``root`` within ``ttl_s``,
    read through an asyncio Redis client (the router's)."""
    found = await aclient.eval(HOLDERS, 1, holders_key(prefix, root), ttl_s)
    return {w.decode() if isinstance(w, bytes) else w for w in found}


class PrefixHolders:
    """The worker's side (a mixin of :class:`~.directory.SessionDirectory`: its client, key
    prefix, heartbeat TTL and ``_call``)."""

    def publish_prefixes(self, worker_id: str, roots: list[str]) -> None:
        """Report that ``worker_id`` holds the shared prefixes named ``roots`` now."""
        if roots:
            keys = [holders_key(self.prefix, r) for r in roots]
            self._call(self.client.eval, PUBLISH, len(keys), *keys, worker_id, self.heartbeat_ttl_s)

    def prefix_holders(self, root: str) -> set[str]:
        """The workers that reported ``root`` within the heartbeat TTL."""
        found = self._call(self.client.eval, HOLDERS, 1, holders_key(self.prefix, root), self.heartbeat_ttl_s)
        return {w.decode() for w in found}
