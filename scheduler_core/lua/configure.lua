--[[ configure: store a queue's policy, atomically.

KEYS[1]  {bg:q}:policy   hash

ARGV[1]  mode: 'ensure' (write only if the queue has no policy yet) | 'replace'
ARGV[2..] field, value pairs (already validated by scheduler_core.policy.Policy)

Returns  {written (0|1), field, value, ...}: the policy now stored.
Errors   {-3, field} malformed argument
]]

local mode = ARGV[1]
if mode ~= 'ensure' and mode ~= 'replace' then return {-3, 'mode'} end
if (#ARGV - 1) % 2 ~= 0 or #ARGV < 3 then return {-3, 'fields'} end
local written = 0
if mode == 'replace' or redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], unpack(ARGV, 2))
  written = 1
end
local reply = {written}
for _, v in ipairs(redis.call('HGETALL', KEYS[1])) do reply[#reply + 1] = v end
return reply
