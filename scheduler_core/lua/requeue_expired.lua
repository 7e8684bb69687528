--[[ requeue_expired: return the requests of batches whose lease has expired to their
queues (any live consumer runs this sweep). A request keeps its arrival time, so it goes
back to the head of its original priority; pop_batch dead-letters it once it has been
delivered max_attempts times.

KEYS[1]  {bg:q}:inflight    zset  batch id -> lease deadline (µs)
KEYS[2]  {bg:q}:batches     hash  batch id -> "consumer|ids"
KEYS[3]  {bg:q}:owner       hash  id -> batch id
KEYS[4]  {bg:q}:meta        hash  id -> meta
KEYS[5]  {bg:q}:pending:0   zset
KEYS[6]  {bg:q}:pending:1   zset
KEYS[7]  {bg:q}:pending:2   zset
KEYS[8]  {bg:q}:marker      zset  wake-up marker
KEYS[9]  {bg:q}:stats       hash  counters (requeued)
KEYS[10] {bg:q}:consumers   zset  consumer -> last heartbeat (µs); pruned here after 1 h

ARGV[1]  most batches to reap in this call (1..1000)

Returns  {batches_reaped, requests_requeued}
Errors   {-3, field} malformed argument
]]
-- @include _common.lua

local limit = int_arg(ARGV[1], 1, 1000)
if not limit then return {-3, 'limit'} end
local now = now_us()
-- Forget consumers silent for an hour, so the set does not grow with every restart.
redis.call('ZREMRANGEBYSCORE', KEYS[10], '-inf', int(now - 3600000000))
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', int(now), 'LIMIT', 0, limit)
local requeued = 0
for _, batch_id in ipairs(expired) do
  for _, id in ipairs(batch_ids(redis.call('HGET', KEYS[2], batch_id))) do
    if redis.call('HGET', KEYS[3], id) == batch_id then
      local m = parse_meta(redis.call('HGET', KEYS[4], id))
      local prio, arrival = 2, now
      if m then prio, arrival = m.prio, m.arrival end
      redis.call('ZADD', KEYS[5 + prio], int(arrival), id)
      redis.call('HDEL', KEYS[3], id)
      requeued = requeued + 1
    end
  end
  redis.call('ZREM', KEYS[1], batch_id)
  redis.call('HDEL', KEYS[2], batch_id)
end
if requeued > 0 then
  redis.call('HINCRBY', KEYS[9], 'requeued', requeued)
  redis.call('ZADD', KEYS[8], 0, 'w')
end
return {#expired, requeued}
