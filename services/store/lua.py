"""Lua scripts: every state change of the store is one script, so it is atomic in Redis.

A store killed between two scripts leaves Redis at a message boundary, and the idempotency
key (trajectory_id, sequence_number) — the trajectory's `next` field — changes in the same
script as the data it guards. Scripts that delete a group derive member keys from the prefix
(ARGV), which is fine on a single Redis (the store does not support Redis Cluster).
Key layout: services/store/keys.py.
"""

from __future__ import annotations

# Shared helpers, prepended to the scripts that need them.
_DELETE_TRAJ = """
local function delete_traj(prefix, tid, ttl, stats)
  local t = prefix .. 't:' .. tid
  local tokens = tonumber(redis.call('HGET', t, 'tokens') or '0')
  if redis.call('HGET', t, 'state') == 'open' then
    redis.call('HINCRBY', stats, 'inflight', -1)
  end
  redis.call('DEL', t)
  redis.call('SET', prefix .. 'td:' .. tid, 1, 'EX', ttl)
  return tokens
end
local function delete_group(prefix, gid, ttl, stats)
  local gm = prefix .. 'gm:' .. gid
  local tokens = 0
  for _, tid in ipairs(redis.call('SMEMBERS', gm)) do
    tokens = tokens + delete_traj(prefix, tid, ttl, stats)
  end
  local g = prefix .. 'g:' .. gid
  local delivered = redis.call('HGET', g, 'dlv')
  if delivered then redis.call('HINCRBY', stats, 'delivered_tokens', -tonumber(delivered)) end
  redis.call('DEL', g, gm)
  redis.call('ZREM', prefix .. 'open', gid)
  redis.call('SET', prefix .. 'gd:' .. gid, 1, 'EX', ttl)
  redis.call('HINCRBY', stats, 'backlog_tokens', -tokens)
end
"""

# Groups ahead of the trainer: open (begun, incomplete) + ready and not yet delivered.
# KEYS: open, ready; ARGV[1]: consumer group. A missing consumer group counts none pending.
_AHEAD = """
local function groups_ahead(open_key, ready_key, cgroup)
  local n = redis.call('ZCARD', open_key) + redis.call('XLEN', ready_key)
  local p = redis.pcall('XPENDING', ready_key, cgroup)
  if type(p) == 'table' and p[1] then n = n - tonumber(p[1]) end
  return n
end
"""

# KEYS: traj, traj_done, group, group_members, group_done, stats, open, ready
# ARGV: tid, header, group_size, prompt_len, max_backlog, max_inflight, now, gid,
#       max_groups_ahead (0 = none), consumer group
BEGIN = _AHEAD + """
if redis.call('EXISTS', KEYS[1]) == 1 or redis.call('EXISTS', KEYS[2]) == 1 then return 'dup' end
if redis.call('EXISTS', KEYS[5]) == 1 then return 'group_done' end
local size = redis.call('HGET', KEYS[3], 'size')
if size and tonumber(size) ~= tonumber(ARGV[3]) then return 'group_size' end
if redis.call('SCARD', KEYS[4]) >= tonumber(ARGV[3]) then return 'group_full' end
-- Admission counts undelivered tokens only (begun + ready, not yet delivered): what a trainer
-- holds until its checkpoint acks it is bounded by max_unacked_tokens at pull instead.
local held = redis.call('HMGET', KEYS[6], 'backlog_tokens', 'delivered_tokens')
if tonumber(held[1] or '0') - tonumber(held[2] or '0') > tonumber(ARGV[5]) then
  return 'backlog'
end
if tonumber(redis.call('HGET', KEYS[6], 'inflight') or '0') >= tonumber(ARGV[6]) then
  return 'inflight'
end
-- Only a new group waits for the budget: members of a begun group always get in.
if (not size) and tonumber(ARGV[9]) > 0 and
    groups_ahead(KEYS[7], KEYS[8], ARGV[10]) >= tonumber(ARGV[9]) then
  return 'groups_ahead'
end
redis.call('HSET', KEYS[1], 'h', ARGV[2], 'gid', ARGV[8], 'next', 1, 'rows', 0,
           'tokens', ARGV[4], 'plen', ARGV[4], 'nseg', 0, 'state', 'open')
if not size then
  redis.call('HSET', KEYS[3], 'size', ARGV[3], 'complete', 0, 't0', ARGV[7])
  redis.call('ZADD', KEYS[7], ARGV[7], ARGV[8])
end
redis.call('SADD', KEYS[4], ARGV[1])
redis.call('HINCRBY', KEYS[3], 'tokens', ARGV[4])
redis.call('HINCRBY', KEYS[6], 'backlog_tokens', ARGV[4])
redis.call('HINCRBY', KEYS[6], 'inflight', 1)
redis.call('HINCRBY', KEYS[6], 'trajectories_appended', 1)
return 'ok'
"""

# Common head of SEGMENT and FINISH: existence, duplicate and gap checks on KEYS[1..2].
_ORDER = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  if redis.call('EXISTS', KEYS[2]) == 1 then return {'dup', 0} end
  return {'missing', 0}
end
local seq = tonumber(ARGV[1])
local nxt = tonumber(redis.call('HGET', KEYS[1], 'next'))
if seq < nxt or redis.call('HGET', KEYS[1], 'state') ~= 'open' then return {'dup', 0} end
if seq > nxt then return {'gap', nxt} end
"""

# A segment is stored as its head `s:<j>` (tokens, no routing), its routing chunks one per hash
# field `r:<j>:<c>` (c = 0 .. `rc:<j>` - 1) and, for segment 0, the group's prompt chunk
# (`pkey`). A segment sent in parts keeps `next` at its own sequence number until its last part;
# `part` is the next part expected, `orows` the rows it still lacks.
# KEYS: traj, traj_done, group, stats
# ARGV: seq, start_row, rows, tokens, head ('' on parts > 0), policy_version, layout,
#       prompt_field, prompt_chunk, part, rows left after this part, chunk 1 .. chunk n
SEGMENT = _ORDER + """
local part = tonumber(ARGV[10])
local want = tonumber(redis.call('HGET', KEYS[1], 'part') or '0')
if part < want then return {'dup', 0} end
if part > want then return {'gap', nxt} end
if tonumber(redis.call('HGET', KEYS[1], 'rows')) ~= tonumber(ARGV[2]) then
  return {'conflict', 0}
end
local layout = redis.call('HGET', KEYS[1], 'layout')
if layout and layout ~= ARGV[7] then return {'conflict', 0} end
local new_prompt = 0
if ARGV[8] ~= '' then
  -- An empty chunk means the store saw this field in Redis before; it cannot have vanished
  -- while this trajectory exists, but a missing chunk must never be referenced.
  if ARGV[9] ~= '' then
    new_prompt = redis.call('HSETNX', KEYS[3], ARGV[8], ARGV[9])
  elseif redis.call('HEXISTS', KEYS[3], ARGV[8]) == 0 then
    return {'conflict', 0}
  end
  redis.call('HSET', KEYS[1], 'pkey', ARGV[8])
end
local j = seq - 1
if part == 0 then
  redis.call('HSET', KEYS[1], 's:' .. j, ARGV[5], 'nseg', seq, 'layout', ARGV[7])
  redis.call('HINCRBY', KEYS[1], 'tokens', ARGV[4])
  local gmin = redis.call('HGET', KEYS[3], 'minpv')
  if (not gmin) or tonumber(ARGV[6]) < tonumber(gmin) then
    redis.call('HSET', KEYS[3], 'minpv', ARGV[6])
  end
  redis.call('HINCRBY', KEYS[3], 'tokens', ARGV[4])
  redis.call('HINCRBY', KEYS[4], 'backlog_tokens', ARGV[4])
end
local c = tonumber(redis.call('HGET', KEYS[1], 'rc:' .. j) or '0')
for i = 12, #ARGV do
  redis.call('HSET', KEYS[1], 'r:' .. j .. ':' .. c, ARGV[i])
  c = c + 1
end
redis.call('HSET', KEYS[1], 'rc:' .. j, c)
redis.call('HINCRBY', KEYS[1], 'rows', ARGV[3])
if tonumber(ARGV[11]) > 0 then
  redis.call('HSET', KEYS[1], 'part', part + 1, 'orows', ARGV[11])
else
  redis.call('HSET', KEYS[1], 'next', seq + 1, 'part', 0, 'orows', 0)
end
return {'ok', new_prompt}
"""

# KEYS: traj, traj_done, group, stats, ready, open
# ARGV: seq, payload, num_segments, aborted (0/1), gid
FINISH = _ORDER + """
if tonumber(redis.call('HGET', KEYS[1], 'part') or '0') > 0 then return {'gap', nxt} end
if tonumber(redis.call('HGET', KEYS[1], 'nseg')) ~= tonumber(ARGV[3]) then
  return {'conflict', 0}
end
redis.call('HSET', KEYS[1], 'f', ARGV[2], 'next', seq + 1, 'state', 'complete')
redis.call('HINCRBY', KEYS[4], 'inflight', -1)
redis.call('HINCRBY', KEYS[4], 'trajectories_complete', 1)
if ARGV[4] == '1' then redis.call('HINCRBY', KEYS[4], 'dropped:aborted', 1) end
local done = redis.call('HINCRBY', KEYS[3], 'complete', 1)
if done == tonumber(redis.call('HGET', KEYS[3], 'size')) then
  redis.call('XADD', KEYS[5], '*', 'g', ARGV[5])
  redis.call('ZREM', KEYS[6], ARGV[5])
  redis.call('HINCRBY', KEYS[4], 'groups_released', 1)
  return {'ok', 1}
end
return {'ok', 0}
"""

# Ack or drop one delivered group. Returns 1 if done now, 0 if not pending, -1 if another
# consumer holds the lease.
# KEYS: ready, stats, leases
# ARGV: prefix, consumer group, entry id, consumer ('' = any), reason ('acked' or a drop
#       reason), tombstone ttl, trajectories to count as dropped
RELEASE = _DELETE_TRAJ + """
local p = redis.call('XPENDING', KEYS[1], ARGV[2], ARGV[3], ARGV[3], 1)
if #p == 0 then return 0 end
if ARGV[4] ~= '' and p[1][2] ~= ARGV[4] then return -1 end
local e = redis.call('XRANGE', KEYS[1], ARGV[3], ARGV[3])
redis.call('XACK', KEYS[1], ARGV[2], ARGV[3])
redis.call('XDEL', KEYS[1], ARGV[3])
redis.call('HDEL', KEYS[3], ARGV[3])
if #e == 1 then delete_group(ARGV[1], e[1][2][2], tonumber(ARGV[6]), KEYS[2]) end
if ARGV[5] == 'acked' then
  redis.call('HINCRBY', KEYS[2], 'groups_acked', 1)
elseif tonumber(ARGV[7]) > 0 then
  redis.call('HINCRBY', KEYS[2], 'dropped:' .. ARGV[5], ARGV[7])
end
return 1
"""

# Close an incomplete group older than the cutoff. Returns {trajectories dropped, released}.
# KEYS: open, stats, ready
# ARGV: prefix, gid, cutoff time, tombstone ttl, policy ('drop' | 'release_partial')
TIMEOUT = _DELETE_TRAJ + """
local t0 = redis.call('ZSCORE', KEYS[1], ARGV[2])
if (not t0) or tonumber(t0) > tonumber(ARGV[3]) then return {0, 0} end
local prefix, gid, ttl = ARGV[1], ARGV[2], tonumber(ARGV[4])
local g, gm = prefix .. 'g:' .. gid, prefix .. 'gm:' .. gid
local complete = tonumber(redis.call('HGET', g, 'complete') or '0')
local members = redis.call('SMEMBERS', gm)
if ARGV[5] == 'release_partial' and complete > 0 then
  local tokens, dropped = 0, 0
  for _, tid in ipairs(members) do
    if redis.call('HGET', prefix .. 't:' .. tid, 'state') ~= 'complete' then
      tokens = tokens + delete_traj(prefix, tid, ttl, KEYS[2])
      redis.call('SREM', gm, tid)
      dropped = dropped + 1
    end
  end
  redis.call('HSET', g, 'size', complete)
  redis.call('HINCRBY', g, 'tokens', -tokens)
  redis.call('HINCRBY', KEYS[2], 'backlog_tokens', -tokens)
  redis.call('HINCRBY', KEYS[2], 'dropped:group_timeout', dropped)
  redis.call('ZREM', KEYS[1], gid)
  redis.call('XADD', KEYS[3], '*', 'g', gid)
  redis.call('HINCRBY', KEYS[2], 'groups_released', 1)
  return {dropped, 1}
end
delete_group(prefix, gid, ttl, KEYS[2])
redis.call('HINCRBY', KEYS[2], 'dropped:group_timeout', #members)
return {#members, 0}
"""

# Count groups as delivered (not yet acked): each group's tokens move from the undelivered
# backlog to `delivered_tokens` once (a redelivery or a renewal adds nothing); RELEASE and
# TIMEOUT take them back out when the group goes. Returns the delivered tokens after the call.
# KEYS: stats; ARGV: prefix, group ids
MARK_DELIVERED = """
for i = 2, #ARGV do
  local g = ARGV[1] .. 'g:' .. ARGV[i]
  if redis.call('EXISTS', g) == 1 and not redis.call('HGET', g, 'dlv') then
    local tokens = redis.call('HGET', g, 'tokens') or '0'
    redis.call('HSET', g, 'dlv', tokens)
    redis.call('HINCRBY', KEYS[1], 'delivered_tokens', tokens)
  end
end
return tonumber(redis.call('HGET', KEYS[1], 'delivered_tokens') or '0')
"""

# Monotonic max: KEYS: key; ARGV: candidate. Returns the stored value after the call.
SET_MAX = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
local new = tonumber(ARGV[1])
if new > cur then redis.call('SET', KEYS[1], ARGV[1]); return ARGV[1] end
return tostring(cur)
"""

# Latest weight-sync plan if newer. KEYS: ws hash; ARGV: version, plan. Returns stored version.
SET_PLAN = """
local cur = tonumber(redis.call('HGET', KEYS[1], 'v') or '-1')
if tonumber(ARGV[1]) > cur then
  redis.call('HSET', KEYS[1], 'v', ARGV[1], 'plan', ARGV[2])
  return ARGV[1]
end
return tostring(cur)
"""

# Run fencing (docs/store.md). KEYS: policy version, run hash; ARGV: run id, candidate version.
# The same run again (a resumed trainer) only raises the version. Another run starts at a
# version above everything the store has seen (unless nothing was ever published: a pristine
# store's engines serve the release's initial weights), recorded as the run's start.
# Returns {version, start version}.
START_RUN = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
local want = tonumber(ARGV[2])
local id = redis.call('HGET', KEYS[2], 'id')
if id == ARGV[1] then
  if want > cur then redis.call('SET', KEYS[1], ARGV[2]); cur = want end
  return {cur, tonumber(redis.call('HGET', KEYS[2], 'start') or '0')}
end
local v = math.max(cur, want)
if id or v > 0 then v = v + 1 end
redis.call('SET', KEYS[1], v)
redis.call('HSET', KEYS[2], 'id', ARGV[1], 'start', v)
return {v, v}
"""
