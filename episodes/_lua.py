"""Lua scripts of the episode store. Each touches only the keys of one rollout (one hash slot)."""

# KEYS[1] rollout hash, KEYS[2] calls list
# ARGV[1] rollout_id, ARGV[2] task_id ('' for none), ARGV[3] created_at, ARGV[4] schema_version,
# ARGV[5] metadata JSON
# Returns 1 when created, 0 when the rollout already existed (nothing changed).
CREATE_ROLLOUT = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
redis.call('HSET', KEYS[1], 'schema_version', ARGV[4], 'rollout_id', ARGV[1], 'task_id', ARGV[2],
           'status', 'open', 'created_at', ARGV[3], 'metadata', ARGV[5])
return 1
"""

# Appends call records to an open rollout, creating the rollout on its first call.
# KEYS[1] rollout hash, KEYS[2] calls list
# ARGV[1] rollout_id, ARGV[2] task_id ('' for none), ARGV[3] now, ARGV[4] schema_version,
# ARGV[5..] call records (JSON)
# Returns {0, first_index} on success, {1, status} when the rollout is not open,
# {2, task_id} when the call names another task than the rollout's.
RECORD_CALLS = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then
  redis.call('HSET', KEYS[1], 'schema_version', ARGV[4], 'rollout_id', ARGV[1], 'task_id', ARGV[2],
             'status', 'open', 'created_at', ARGV[3], 'metadata', '{}')
elseif status ~= 'open' then
  return {1, status}
elseif ARGV[2] ~= '' then
  local task = redis.call('HGET', KEYS[1], 'task_id')
  if task == '' then
    redis.call('HSET', KEYS[1], 'task_id', ARGV[2])
  elseif task ~= ARGV[2] then
    return {2, task}
  end
end
local n = redis.call('RPUSH', KEYS[2], unpack(ARGV, 5))
return {0, n - (#ARGV - 4)}
"""
