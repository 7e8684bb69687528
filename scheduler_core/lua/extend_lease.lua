--[[ extend_lease: heartbeat a consumer and, if it holds a batch, renew its lease.

KEYS[1..43] the queue's shared keys, in the order of scheduler_core.keys.SHARED_KEYS;
            this script uses:
KEYS[7]  {bg:q}:clock       string last arrival score issued (the queue's clock: queue_now)
KEYS[9]  {bg:q}:stats       hash  the queue's clock (clock_offset_us, clock_seen_us)
KEYS[10] {bg:q}:inflight    zset  batch id -> lease deadline (µs)
KEYS[14] {bg:q}:consumers   zset  consumer -> last heartbeat (µs)

ARGV[1]  consumer name
ARGV[2]  batch id, or '' when the consumer holds none
ARGV[3]  lease in ms (100..86400000), counted from now

Returns  1 lease renewed (or no batch held), 0 the batch is no longer in flight: its
         lease expired and it was re-queued, so the consumer's result will be refused.
Errors   {-3, field} malformed argument
]]
-- @include _common.lua

local clock = KEYS[7]
local stats = KEYS[9]
local inflight = KEYS[10]
local consumers = KEYS[14]

local lease_ms = int_arg(ARGV[3], 100, 86400000)
if not lease_ms then return {-3, 'lease_ms'} end
if #ARGV ~= 3 or ARGV[1] == '' then return {-3, 'consumer'} end
local consumer, batch_id = ARGV[1], ARGV[2]
local now = queue_now(clock, stats)
redis.call('ZADD', consumers, int(now), consumer)
if batch_id == '' then return 1 end
if not redis.call('ZSCORE', inflight, batch_id) then return 0 end
redis.call('ZADD', inflight, 'XX', int(now + lease_ms * 1000), batch_id)
return 1
