--[[ extend_lease: heartbeat a consumer and, if it holds a batch, renew its lease.

KEYS[1]  {bg:q}:inflight    zset  batch id -> lease deadline (µs)
KEYS[2]  {bg:q}:consumers   zset  consumer -> last heartbeat (µs)

ARGV[1]  consumer name
ARGV[2]  batch id, or '' when the consumer holds none
ARGV[3]  lease in ms (100..86400000), counted from now

Returns  1 lease renewed (or no batch held), 0 the batch is no longer in flight: its
         lease expired and it was re-queued, so the consumer's result will be refused.
Errors   {-3, field} malformed argument
]]
-- @include _common.lua

local lease_ms = int_arg(ARGV[3], 100, 86400000)
if not lease_ms then return {-3, 'lease_ms'} end
if #ARGV ~= 3 or ARGV[1] == '' then return {-3, 'consumer'} end
local now = now_us()
redis.call('ZADD', KEYS[2], int(now), ARGV[1])
if ARGV[2] == '' then return 1 end
if not redis.call('ZSCORE', KEYS[1], ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], 'XX', int(now + lease_ms * 1000), ARGV[2])
return 1
