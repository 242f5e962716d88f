"""The session directory's Lua scripts: each runs atomically inside Redis, so a turn's
metadata, tokens, turn mark and messages land together or not at all.

The field names of a session's entry hash are :class:`~.directory.SessionEntry`'s; the
scripts read only ``version``, ``owner`` and ``epoch`` themselves.
"""

# KEYS: 1 entry hash, 2 token log, 3 message log, 4 turn marks.  Every script re-applies the TTL to all four.
TTL = """
for i = 1, 4 do
  if redis.call('EXISTS', KEYS[i]) == 1 then redis.call('EXPIRE', KEYS[i], ARGV[1]) end
end
"""

# ARGV: ttl, token chunk, message chunk, marks chunk, field/value pairs...
CREATE = (
    """
if redis.call('EXISTS', KEYS[1]) == 1 then return -2 end
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4])
for i = 2, 4 do
  if ARGV[i] ~= '' then redis.call('RPUSH', KEYS[i], ARGV[i]) end
end
redis.call('HSET', KEYS[1], 'version', 1, unpack(ARGV, 5))
"""
    + TTL
    + """
return 1
"""
)

# ARGV: ttl, expected version, replace, token chunk, message chunk, marks chunk, field/value
# pairs... replace "1": the chunks are the whole logs, which they replace (a session taken
# back to one of its turn boundaries and given a new turn from there); else they are appended.
COMMIT = (
    """
local v = redis.call('HGET', KEYS[1], 'version')
if not v then return -1 end
if tonumber(v) ~= tonumber(ARGV[2]) then return -2 end
if ARGV[3] == '1' then redis.call('DEL', KEYS[2], KEYS[3], KEYS[4]) end
for i = 2, 4 do
  if ARGV[i + 2] ~= '' then redis.call('RPUSH', KEYS[i], ARGV[i + 2]) end
end
local nv = tonumber(v) + 1
redis.call('HSET', KEYS[1], 'version', nv, unpack(ARGV, 7))
"""
    + TTL
    + """
return nv
"""
)

# Re-register a session a worker holds: write it back when the entry is gone (Redis
# restarted empty) or older than the worker's copy (turns served while Redis was down).
# ARGV: ttl, version, whole token log, whole message log, all marks, field/value pairs...
RESTORE = (
    """
local v = redis.call('HGET', KEYS[1], 'version')
if v and tonumber(v) >= tonumber(ARGV[2]) then return 0 end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4])
for i = 2, 4 do
  if ARGV[i + 1] ~= '' then redis.call('RPUSH', KEYS[i], ARGV[i + 1]) end
end
redis.call('HSET', KEYS[1], 'version', ARGV[2], unpack(ARGV, 6))
"""
    + TTL
    + """
return 1
"""
)

# Where a session's KV now lies, after its holder demoted it: written only while the entry
# still names that holder (a newer owner's entry is left alone). ARGV: owner, epoch, tier.
SET_TIER = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], 'tier', ARGV[3])
return 1
"""
