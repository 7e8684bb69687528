--[[ requeue_expired: return the requests of batches whose lease has expired to their
queues (any live consumer runs this sweep). A request keeps its arrival time, so it goes
back to the head of its original priority; pop_batch dead-letters it once it has been
delivered max_attempts times.

KEYS[1..43] the queue's shared keys, in the order of scheduler_core.keys.SHARED_KEYS;
            this script uses:
KEYS[1]  {bg:q}:policy      hash  read: cost_buckets (the bucket sets and markers)
KEYS[2]  {bg:q}:pending:0   zset  HIGH
KEYS[3]  {bg:q}:pending:1   zset  NORMAL
KEYS[4]  {bg:q}:pending:2   zset  LOW
KEYS[5]  {bg:q}:jobs        hash  id -> "<meta>|<envelope>": a returned request's attempts
                                  count the delivery that ended without a result
KEYS[6]  {bg:q}:costs       hash  id -> "<cost>:<bucket>:<prio>": a returned request's entry
KEYS[7]  {bg:q}:clock       string last arrival score issued (the queue's clock: queue_now)
KEYS[8]  {bg:q}:marker      zset  wake-up marker
KEYS[9]  {bg:q}:stats       hash  counters (requeued); the queue's clock
KEYS[10] {bg:q}:inflight    zset  batch id -> lease deadline (µs)
KEYS[11] {bg:q}:owner       hash  id -> batch id
KEYS[12] {bg:q}:batches     hash  batch id -> "consumer|ids"
KEYS[14] {bg:q}:consumers   zset  consumer -> last heartbeat (µs); pruned here after 1 h
KEYS[20] {bg:q}:deadlines   zset  pending id -> deadline (µs): a returned request with a
                                  deadline is listed again (expire_due.lua answers it
                                  if it has passed)
KEYS[24..28] {bg:q}:marker:<1..5> zset  wake-up markers of consumers dedicated to a cost bucket
KEYS[29..33] {bg:q}:bucket:<1..5> zset  the ids waiting in each cost bucket (score = arrival)
KEYS[35] {bg:q}:tenants     hash  per named tenant's counters (lua/_tenants.lua)
KEYS[37..39] {bg:q}:fair:<0..2> zset  fairness requests | cost (lua/_fair.lua): waiting
                                  requests by tenant, then arrival
KEYS[40..42] {bg:q}:vtc:<0..2> zset  the backlogged tenants of each level -> virtual counter
KEYS[43] {bg:q}:fair:who    hash  id -> tenant of each request in the fair sets

ARGV[1]  most batches to reap in this call (1..1000)

Returns  {batches_reaped, requests_requeued}
Errors   {-3, field} malformed argument
]]
-- @include _common.lua
-- @include _policy.lua
-- @include _tenants.lua
-- @include _fair.lua
-- @include _queue.lua

local policy = KEYS[1]
local pending_high = KEYS[2]
local pending_normal = KEYS[3]
local pending_low = KEYS[4]
local jobs = KEYS[5]
local costs = KEYS[6]
local clock = KEYS[7]
local marker = KEYS[8]
local stats = KEYS[9]
local inflight = KEYS[10]
local owner = KEYS[11]
local batches = KEYS[12]
local consumers = KEYS[14]
local deadlines = KEYS[20]
local bucket_markers = {KEYS[24], KEYS[25], KEYS[26], KEYS[27], KEYS[28]}
local bucket_sets = {KEYS[29], KEYS[30], KEYS[31], KEYS[32], KEYS[33]}
local tenants = KEYS[35]
local fair_sets = {KEYS[37], KEYS[38], KEYS[39]}
local fair_counters = {KEYS[40], KEYS[41], KEYS[42]}
local fair_who = KEYS[43]

local limit = int_arg(ARGV[1], 1, 1000)
if not limit then return {-3, 'limit'} end
local pending = {pending_high, pending_normal, pending_low}
local now = queue_now(clock, stats)
-- Forget consumers silent for an hour, so the set does not grow with every restart.
redis.call('ZREMRANGEBYSCORE', consumers, '-inf', int(now - 3600000000))
local expired = redis.call('ZRANGEBYSCORE', inflight, '-inf', int(now), 'LIMIT', 0, limit)
local requeued, bounds, fair = 0, nil, nil  -- bounds, fair: read with the first re-queued
local tally = tenant_tally()  -- tenants (lua/_tenants.lua): back from in flight to waiting
for _, batch_id in ipairs(expired) do
  for _, id in ipairs(batch_members(batches, batch_id)) do
    if redis.call('HGET', owner, id) == batch_id then
      local m = parse_job(redis.call('HGET', jobs, id))
      if m then
        m.attempts = m.attempts + 1
        redis.call('HSET', jobs, id, format_job(m))
      end
      if not bounds then
        bounds = stored_bounds(policy)
        fair = fair_open(policy, fair_sets, fair_counters, fair_who)
      end
      return_to_waiting(pending, costs, deadlines, bucket_sets, bounds, id, m, now, fair)
      redis.call('HDEL', owner, id)
      requeued = requeued + 1
      local t = m and envelope_tenant(m.envelope)
      if t then
        tally.add_tenant(t, 'f', -1)
        tally.add_tenant(t, 'w', 1)
      end
    end
  end
  release_batch(inflight, batches, batch_id)
end
if requeued > 0 then
  tally.flush(tenants)
  redis.call('HINCRBY', stats, 'requeued', requeued)
  wake_consumers(marker)
  wake_buckets(bucket_markers, bucket_count(bounds))
end
return {#expired, requeued}
