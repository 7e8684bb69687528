--[[ configure: store a queue's policy, atomically.

KEYS[1]  {bg:q}:policy   hash

ARGV[1]  mode: 'ensure' (write only if the queue has no policy yet) | 'replace'
ARGV[2..] field, value pairs: strategy and every field of LIMITS below, each within its
         range (scheduler_core.policy.Policy validates them first); other fields are
         kept if their name is [a-z_] and their value at most 256 bytes

Returns  {written (0|1), field, value, ...}: the policy now stored.
Errors   {-3, field} malformed argument, nothing written
]]
-- @include _common.lua

-- The same ranges as scheduler_core.policy.LIMITS (a test keeps the two equal).
local LIMITS = {max_batch_size = {1, 4096}, max_queue_delay_ms = {0, 600000},
                aging_ms = {0, 86400000}, max_queue_size = {0, 1000000000},
                max_attempts = {1, 100}, result_ttl_s = {1, 2592000}}
local STRATEGIES = {fifo = true, dynamic = true, priority = true}

local mode = ARGV[1]
if mode ~= 'ensure' and mode ~= 'replace' then return {-3, 'mode'} end
if (#ARGV - 1) % 2 ~= 0 or #ARGV < 3 then return {-3, 'fields'} end
local given = {}
for i = 2, #ARGV, 2 do
  local field, value = ARGV[i], ARGV[i + 1]
  if field == 'strategy' then
    if not STRATEGIES[value] then return {-3, field} end
  elseif LIMITS[field] then
    if not int_arg(value, LIMITS[field][1], LIMITS[field][2]) then return {-3, field} end
  elseif #field > 64 or not string.match(field, '^[a-z_]+$') or #value > 256 then
    return {-3, 'fields'}
  end
  given[field] = true
end
if not given['strategy'] then return {-3, 'strategy'} end
for field in pairs(LIMITS) do
  if not given[field] then return {-3, field} end
end
local written = 0
if mode == 'replace' or redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], unpack(ARGV, 2))
  written = 1
end
local reply = {written}
for _, v in ipairs(redis.call('HGETALL', KEYS[1])) do reply[#reply + 1] = v end
return reply
