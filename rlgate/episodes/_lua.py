"""Lua scripts of the episode store. Each touches only the keys of one rollout (one hash slot), or one
global key (the outbox, the stream); the lifecycle they implement is described in `rlgate.episodes.keys`."""

# KEYS[1] rollout hash
# ARGV[1] rollout_id, ARGV[2] task_id ('' for none), ARGV[3] created_at, ARGV[4] schema_version,
# ARGV[5] metadata JSON, ARGV[6] expires_at, ARGV[7] mode (train or val)
# Returns 1 when created, 0 when the rollout already existed (nothing changed).
CREATE_ROLLOUT = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
redis.call('HSET', KEYS[1], 'schema_version', ARGV[4], 'rollout_id', ARGV[1], 'task_id', ARGV[2],
           'status', 'open', 'created_at', ARGV[3], 'metadata', ARGV[5], 'expires_at', ARGV[6], 'mode', ARGV[7])
return 1
"""

# Appends call records to an open rollout, creating the rollout on its first call.
# KEYS[1] rollout hash, KEYS[2] calls list, KEYS[3] (an attempt only) the hash of the rollout it is an
# attempt of (same hash tag)
# ARGV[1] rollout_id, ARGV[2] task_id ('' for none), ARGV[3] now, ARGV[4] schema_version,
# ARGV[5] expires_at (for a rollout created here), ARGV[6] '1' when the rollout must already exist (a call
# with a rollout key: POST /rollouts made it, so a missing hash means Redis lost it), ARGV[7] the most
# records a rollout may hold ('0': no limit), ARGV[8] the mode the call asks for ('' any; a rollout created
# here gets 'train' then), ARGV[9] the most attempts a rollout may have, ARGV[10] the calling agent's name
# ('' for none), ARGV[11] the policy version that served the records, ARGV[12] the records' bytes,
# ARGV[13] the most bytes the rollout may hold, its attempts' and events' included ('0': no limit),
# ARGV[14..] call records (JSON)
# The rollout hash keeps what a listing shows without reading records: `agent_name` (the first named
# agent's), `first_version` and `last_version` (the lowest and highest policy version that served it).
# An attempt is created only while its rollout exists and is open or failed, with the rollout's task and
# mode, and counted in the rollout's `attempts`.
# Returns {0, first_index, created (0/1)} on success, {1, status} when the rollout is not open,
# {2, task_id} when the call names another task than the rollout's, {3} when it (an attempt: its
# rollout) must exist and does not, {4, records held} when these records would take it above its limit,
# {5, mode} when the rollout is of another mode than the call asks for, {6, status} when an attempt's
# rollout is closed, {7, limit} when the rollout has had its most attempts, {8, bytes held} when these
# records would take the rollout (an attempt: the rollout it is an attempt of) above its byte budget.
# The rollout's hash counts what it holds in `bytes` (an attempt's in its rollout's).
RECORD_CALLS = """
local n_records = #ARGV - 13
local status = redis.call('HGET', KEYS[1], 'status')
local limit = tonumber(ARGV[7])
if limit > 0 and (status == false or status == 'open') then
  local held = redis.call('LLEN', KEYS[2])
  if held + n_records > limit then
    return {4, held}
  end
end
local root = KEYS[3] or KEYS[1]
local budget = tonumber(ARGV[13])
if budget > 0 and (status == false or status == 'open') then
  local held = tonumber(redis.call('HGET', root, 'bytes') or '0')
  if held + tonumber(ARGV[12]) > budget then
    return {8, held}
  end
end
local created = 0
if not status then
  local task, mode = ARGV[2], ARGV[8]
  if KEYS[3] then
    local parent = redis.call('HMGET', KEYS[3], 'status', 'task_id', 'mode')
    if not parent[1] then
      return {3}
    end
    if parent[1] ~= 'open' and parent[1] ~= 'failed' then
      return {6, parent[1]}
    end
    local parent_mode = parent[3] or 'train'
    if mode ~= '' and mode ~= parent_mode then
      return {5, parent_mode}
    end
    local parent_task = parent[2] or ''
    if task ~= '' and task ~= parent_task then
      return {2, parent_task}
    end
    if tonumber(redis.call('HGET', KEYS[3], 'attempts') or '0') >= tonumber(ARGV[9]) then
      return {7, ARGV[9]}
    end
    redis.call('HINCRBY', KEYS[3], 'attempts', 1)
    task, mode = parent_task, parent_mode
  elseif ARGV[6] == '1' then
    return {3}
  end
  if mode == '' then
    mode = 'train'
  end
  redis.call('HSET', KEYS[1], 'schema_version', ARGV[4], 'rollout_id', ARGV[1], 'task_id', task,
             'status', 'open', 'created_at', ARGV[3], 'metadata', '{}', 'expires_at', ARGV[5], 'mode', mode)
  created = 1
elseif status ~= 'open' then
  return {1, status}
end
if created == 0 and ARGV[8] ~= '' then
  local mode = redis.call('HGET', KEYS[1], 'mode') or 'train'
  if mode ~= ARGV[8] then
    return {5, mode}
  end
end
if created == 0 and ARGV[2] ~= '' then
  local task = redis.call('HGET', KEYS[1], 'task_id')
  if task == '' then
    redis.call('HSET', KEYS[1], 'task_id', ARGV[2])
  elseif task ~= ARGV[2] then
    return {2, task}
  end
end
local seen = redis.call('HMGET', KEYS[1], 'agent_name', 'first_version', 'last_version')
local version, changed = tonumber(ARGV[11]) or 0, {}
if not seen[1] and ARGV[10] ~= '' then
  changed[#changed + 1] = 'agent_name'
  changed[#changed + 1] = ARGV[10]
end
if version < (tonumber(seen[2]) or math.huge) then
  changed[#changed + 1] = 'first_version'
  changed[#changed + 1] = ARGV[11]
end
if version > (tonumber(seen[3]) or -1) then
  changed[#changed + 1] = 'last_version'
  changed[#changed + 1] = ARGV[11]
end
local n = redis.call('RPUSH', KEYS[2], unpack(ARGV, 14))
if #changed > 0 then
  redis.call('HSET', KEYS[1], unpack(changed))
end
if root == KEYS[1] or redis.call('EXISTS', root) == 1 then  -- a parent gone (expired) is not remade
  redis.call('HINCRBY', root, 'bytes', ARGV[12])
end
return {0, n - n_records, created}
"""

# Retention, part of the scripts that end a rollout for good (consumed, expired, failed): every key of the
# rollout (KEYS, all of one hash slot) expires in `ms` milliseconds; '0' keeps them.
_RETAIN = """
local function retain(ms)
  if tonumber(ms) > 0 then
    for i = 1, #KEYS do
      redis.call('PEXPIRE', KEYS[i], ms)
    end
  end
end
"""

# Closes an open rollout with its final return, exactly once.
# KEYS[1] rollout hash
# ARGV[1] reward (canonical repr), ARGV[2] reward metadata JSON, ARGV[3] now
# Returns {'closed', task_id, mode, first_version ('' if none)} to the one caller that closed it;
# {'same', published} when it was already closed with this reward; {'conflict', reward} when closed with another; {status} when missing,
# expired or failed.
CLOSE = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then
  return {'missing'}
end
if status == 'open' then
  redis.call('HSET', KEYS[1], 'status', 'closed', 'reward', ARGV[1], 'reward_metadata', ARGV[2],
             'closed_at', ARGV[3], 'published', '0')
  local fields = redis.call('HMGET', KEYS[1], 'task_id', 'mode', 'first_version')
  return {'closed', fields[1] or '', fields[2] or 'train', fields[3] or ''}
end
if status == 'closed' or status == 'consumed' then
  local reward = redis.call('HGET', KEYS[1], 'reward')
  if reward == ARGV[1] then
    -- written again, unchanged: a WAIT after this reply covers the replication of the close however
    -- long ago and over whichever connection it happened (WAIT counts the caller's own writes only)
    redis.call('HSET', KEYS[1], 'reward', reward)
    return {'same', redis.call('HGET', KEYS[1], 'published') or '1'}
  end
  return {'conflict', reward}
end
return {status}
"""

# Records a closer's intent in the outbox before it closes (a script, so that with `wait_replicas` it is
# durable: the sweeper publishes a closed episode from it if the closer dies or its stream entry is lost).
# KEYS[1] the outbox; ARGV[1] the intent's time, ARGV[2] the intent
OUTBOX_ADD = """
return redis.call('ZADD', KEYS[1], ARGV[1], ARGV[2])
"""

# Adds a closed episode to the stream (a script, so that with `wait_replicas` it goes over the store's durable
# connections like the close it follows: `EpisodeStore.durable_script`).
# KEYS[1] the closed-episode stream; ARGV field, value, field, value, ...
# Returns the entry's id.
ADD_EPISODE = """
return redis.call('XADD', KEYS[1], '*', unpack(ARGV))
"""

# Marks a closed rollout as published to the stream; returns 1 if it was not yet, else 0.
# KEYS[1] rollout hash
MARK_PUBLISHED = """
if redis.call('HGET', KEYS[1], 'published') == '0' then
  redis.call('HSET', KEYS[1], 'published', '1')
  return 1
end
return 0
"""

# Expires an open rollout whose time has passed, or closes it with a fill reward.
# KEYS the rollout's keys, its hash first (`Keys.rollout_keys`)
# ARGV[1] now, ARGV[2] fill reward (canonical repr, '' for none), ARGV[3] retention in ms (expired, failed)
# Returns {'expired'}, {'closed'} (filled), {'failed'}, {'not_due', expires_at} or {'not_open'}. A
# rollout with a pending reward job (a `finish` request) is never filled: its job died (say, a killed
# worker) or never ran, so it is `failed`, with that as its error.
EXPIRE = (
    _RETAIN
    + """
if redis.call('HGET', KEYS[1], 'status') ~= 'open' then
  return {'not_open'}
end
local expires_at = redis.call('HGET', KEYS[1], 'expires_at') or '0'
if tonumber(expires_at) > tonumber(ARGV[1]) then
  return {'not_due', expires_at}
end
if redis.call('HEXISTS', KEYS[1], 'finish') == 1 then
  redis.call('HSET', KEYS[1], 'status', 'failed', 'closed_at', ARGV[1],
             'error', 'the reward job did not close the episode before its TTL')
  retain(ARGV[3])
  return {'failed'}
end
if ARGV[2] ~= '' then
  redis.call('HSET', KEYS[1], 'status', 'closed', 'reward', ARGV[2], 'closed_at', ARGV[1],
             'reward_metadata', '{"filled": true}', 'published', '0')
  return {'closed'}
end
redis.call('HSET', KEYS[1], 'status', 'expired', 'closed_at', ARGV[1])
retain(ARGV[3])
return {'expired'}
"""
)

# Marks an open rollout failed (its reward job gave up).
# KEYS the rollout's keys, its hash first; ARGV[1] error, ARGV[2] now, ARGV[3] retention in ms
# Returns the status before ('open' means it failed now; '' when missing).
FAIL = (
    _RETAIN
    + """
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'open' then
  redis.call('HSET', KEYS[1], 'status', 'failed', 'error', ARGV[1], 'closed_at', ARGV[2])
  retain(ARGV[3])
end
return status or ''
"""
)

# Marks a closed rollout consumed by a learner; returns 1 the first time, else 0.
# KEYS the rollout's keys, its hash first; ARGV[1] now, ARGV[2] retention in ms
CONSUME = (
    _RETAIN
    + """
if redis.call('HGET', KEYS[1], 'status') == 'closed' then
  redis.call('HSET', KEYS[1], 'status', 'consumed', 'consumed_at', ARGV[1])
  retain(ARGV[2])
  return 1
end
return 0
"""
)

# Attaches an intermediate reward to one call of an open rollout. A closed one takes no more: a learner
# may already have read it, and a reward it never sees must be refused, not silently kept.
# KEYS[1] rollout hash, KEYS[2] calls list, KEYS[3] rewards hash (webhook) or AIR hash
# ARGV[1] call index, ARGV[2] reward (canonical repr)
# Returns {'ok'}, {'missing'}, {'no_call'} or {status} when the rollout takes no more rewards.
SET_CALL_REWARD = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then
  return {'missing'}
end
if status ~= 'open' then
  return {status}
end
if tonumber(ARGV[1]) >= redis.call('LLEN', KEYS[2]) then
  return {'no_call'}
end
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
return {'ok'}
"""

# Saves the reward job's request on an open rollout; returns the status ('' when missing).
# KEYS[1] rollout hash; ARGV[1] finish request JSON
SET_FINISH = """
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'open' then
  redis.call('HSET', KEYS[1], 'finish', ARGV[1])
end
return status or ''
"""

# A learner claims a closed rollout before training on it, so that an episode published twice (the
# outbox repair after a closer died between XADD and marking it published) trains once: in one step,
# and across learners. The claim is a lease (Redis's clock, so learners on several hosts agree): a dead
# learner's claim lapses, and the one that takes over its pending stream entries (XAUTOCLAIM) can claim
# the rollout then. The owner renews its own (before its checkpoint and push).
# KEYS[1] rollout hash
# ARGV[1] owner (the learner's consumer name), ARGV[2] lease in milliseconds
# Returns 1 (claimed by ARGV[1]), 0 (not closed any more) or -1 (another learner's lease runs).
CLAIM = """
if redis.call('HGET', KEYS[1], 'status') ~= 'closed' then
  return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local owner = redis.call('HGET', KEYS[1], 'claimed_by')
local till = tonumber(redis.call('HGET', KEYS[1], 'claimed_until_ms') or '0')
if owner and owner ~= ARGV[1] and till > now then
  return -1
end
redis.call('HSET', KEYS[1], 'claimed_by', ARGV[1], 'claimed_until_ms', tostring(now + tonumber(ARGV[2])))
return 1
"""

# Keeps an event an agent posted (Agent Lightning's event route) with its open rollout.
# KEYS[1] rollout hash, KEYS[2] events list, KEYS[3] (an attempt only) its rollout's hash; ARGV[1] the
# event (JSON), ARGV[2] the most events kept, ARGV[3] the rollout's byte budget ('0': none; RECORD_CALLS)
# Returns {0, index}, {1, status} when the rollout is not open ('' when missing), {2} when it holds the most,
# {3, bytes held} when the event would take the rollout above its byte budget.
APPEND_EVENT = """
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'open' then
  return {1, status or ''}
end
if redis.call('LLEN', KEYS[2]) >= tonumber(ARGV[2]) then
  return {2}
end
local root = KEYS[3] or KEYS[1]
local held = tonumber(redis.call('HGET', root, 'bytes') or '0')
if tonumber(ARGV[3]) > 0 and held + #ARGV[1] > tonumber(ARGV[3]) then
  return {3, held}
end
if root == KEYS[1] or redis.call('EXISTS', root) == 1 then  -- a parent gone (expired) is not remade
  redis.call('HINCRBY', root, 'bytes', #ARGV[1])
end
return {0, redis.call('RPUSH', KEYS[2], ARGV[1]) - 1}
"""

# Agent Lightning's controller changes a rollout's state (`rlgate.episodes.agl_queue`): queuing -> running or
# failed, running -> succeeded or failed; other fields of its status patch are set as given.
# KEYS[1] the rollout's agl hash
# ARGV[1] new state ('' to keep it), ARGV[2] last_attempt_id, ARGV[3] error_message, ARGV[4] k8s_job_name
# ('' each: unchanged), ARGV[5] now
# Returns {'ok', state} when applied, {'conflict', state} for a transition its state machine refuses,
# {'missing'} when the rollout has no agl hash.
AGL_PATCH = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then
  return {'missing'}
end
local to = ARGV[1]
if to ~= '' and to ~= state then
  local allowed = (state == 'queuing' and (to == 'running' or to == 'failed'))
    or (state == 'running' and (to == 'succeeded' or to == 'failed'))
  if not allowed then
    return {'conflict', state}
  end
  redis.call('HSET', KEYS[1], 'state', to)
  state = to
end
if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], 'last_attempt_id', ARGV[2]) end
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'error_message', ARGV[3]) end
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'k8s_job_name', ARGV[4]) end
redis.call('HINCRBY', KEYS[1], 'version', 1)
redis.call('HSET', KEYS[1], 'updated_at', ARGV[5])
return {'ok', state}
"""

# Trims the closed-episode stream: removes the entries every consumer group has acknowledged (older than
# each group's oldest pending entry, and up to its last delivered one when none is pending) that are older
# than a cutoff. Nothing while no group exists (the episodes wait for their first learner). New entries
# always get higher ids than any delivered one, so a trim never removes an entry a group has yet to read.
# KEYS[1] the stream; ARGV[1] cutoff: a stream id (ms-0), entries below it may go
# Returns {entries removed, a group that holds back entries older than the cutoff ('' for none): one with
# such an entry pending, or not yet delivered to it}.
TRIM_EPISODES = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {0, ''}
end
local function parse(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return ms, seq
end
local function less(a, b)
  local am, as = parse(a)
  local bm, bs = parse(b)
  return tonumber(am) < tonumber(bm) or (am == bm and tonumber(as) < tonumber(bs))
end
local groups = redis.call('XINFO', 'GROUPS', KEYS[1])
if #groups == 0 then
  return {0, ''}
end
if ARGV[2] ~= '' then  -- the learners' group must exist: an exporter's group alone does not train them
  local found = false
  for _, group in ipairs(groups) do
    for i = 1, #group, 2 do
      if group[i] == 'name' and group[i + 1] == ARGV[2] then found = true end
    end
  end
  if not found then
    return {0, ''}
  end
end
local cutoff = ARGV[1]
local bound = cutoff
local holder = ''
for _, group in ipairs(groups) do
  local name, last
  for i = 1, #group, 2 do
    if group[i] == 'name' then name = group[i + 1] end
    if group[i] == 'last-delivered-id' then last = group[i + 1] end
  end
  local pending = redis.call('XPENDING', KEYS[1], name)
  local keep
  local holds = false
  if tonumber(pending[1]) > 0 then
    keep = pending[2]  -- its oldest pending entry (never after its last delivered one)
    holds = less(keep, cutoff)
  else
    local ms, seq = parse(last)  -- everything up to its last delivered entry is acknowledged
    keep = ms .. '-' .. string.format('%d', tonumber(seq) + 1)
  end
  if not holds and #redis.call('XRANGE', KEYS[1], '(' .. last, '(' .. cutoff, 'COUNT', 1) > 0 then
    holds = true  -- entries older than the cutoff it has not been given yet
  end
  if less(keep, bound) then
    bound = keep
  end
  if holds and holder == '' then
    holder = name
  end
end
return {redis.call('XTRIM', KEYS[1], 'MINID', bound), holder}
"""
