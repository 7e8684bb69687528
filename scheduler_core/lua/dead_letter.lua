--[[ dead_letter: retry or purge dead-lettered requests (`batchgate dead-letter`).

KEYS[1..43] the queue's shared keys, in the order of scheduler_core.keys.SHARED_KEYS;
            this script uses:
KEYS[1]  {bg:q}:policy        hash   read: cost_buckets (the bucket sets and markers)
KEYS[2]  {bg:q}:pending:0     zset   HIGH
KEYS[3]  {bg:q}:pending:1     zset   NORMAL
KEYS[4]  {bg:q}:pending:2     zset   LOW
KEYS[5]  {bg:q}:jobs          hash   id -> "<meta>|<envelope>"
KEYS[6]  {bg:q}:costs         hash   id -> "<cost>:<bucket>:<prio>": a retried request's entry
KEYS[7]  {bg:q}:clock         string last arrival score issued
KEYS[8]  {bg:q}:marker        zset   wake-up marker for idle consumers
KEYS[9]  {bg:q}:stats         hash   counters (dead_retried, dead_purged); the queue's clock
KEYS[15] {bg:q}:dead          zset   dead-lettered id -> time (µs)
KEYS[16] {bg:q}:dead:reason   hash   id -> error envelope
KEYS[24..28] {bg:q}:marker:<1..5> zset  wake-up markers of consumers dedicated to a cost bucket
KEYS[29..33] {bg:q}:bucket:<1..5> zset  the ids waiting in each cost bucket (score = arrival)
KEYS[35] {bg:q}:tenants     hash  per named tenant's counters (lua/_tenants.lua)
KEYS[37..39] {bg:q}:fair:<0..2> zset  fairness requests | cost (lua/_fair.lua): waiting
                                  requests by tenant, then arrival
KEYS[40..42] {bg:q}:vtc:<0..2> zset  the backlogged tenants of each level -> virtual counter
KEYS[43] {bg:q}:fair:who    hash  id -> tenant of each request in the fair sets
KEYS[43+i] {bg:q}:result:<id_i>  the stored result of request i (for i = 1..n)

ARGV[1]  action: 'retry' | 'purge'
ARGV[2]  n, the number of ids (1..1000)
ARGV[3..2+n] request ids

retry  the request is enqueued again as a new arrival at its original priority, with
       its attempts reset, no deadline and no producer (the producer already received
       its DeadLettered result; the new one is stored by id, keep = 1, and fetched
       by id); its stored result is deleted until then. An entry without a stored request envelope stays dead.
purge  the request (its jobs field) and its dead-letter entry are deleted.

Returns  {done, skipped}: ids acted on; ids skipped (not dead-lettered, or not retryable)
Errors   {-3, field} malformed argument, nothing written
Work is bounded by n.
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
local dead = KEYS[15]
local dead_reason = KEYS[16]
local bucket_markers = {KEYS[24], KEYS[25], KEYS[26], KEYS[27], KEYS[28]}
local bucket_sets = {KEYS[29], KEYS[30], KEYS[31], KEYS[32], KEYS[33]}
local tenants = KEYS[35]
local fair_sets = {KEYS[37], KEYS[38], KEYS[39]}
local fair_counters = {KEYS[40], KEYS[41], KEYS[42]}
local fair_who = KEYS[43]

local action = ARGV[1]
if action ~= 'retry' and action ~= 'purge' then return {-3, 'action'} end
local n = int_arg(ARGV[2], 1, 1000)
if not n or #ARGV ~= 2 + n or #KEYS ~= 43 + n then return {-3, 'n'} end

local pending = {pending_high, pending_normal, pending_low}
local done, skipped = 0, 0
local arrivals, bounds, fair = nil, nil, nil  -- read on the first retry
local tally = tenant_tally()  -- tenants (lua/_tenants.lua): a retried request waits again
for i = 1, n do
  local id = ARGV[2 + i]
  if not redis.call('ZSCORE', dead, id) then
    skipped = skipped + 1
  elseif action == 'purge' then
    redis.call('ZREM', dead, id)
    redis.call('HDEL', dead_reason, id)
    redis.call('HDEL', jobs, id)
    done = done + 1
  elseif id == '' or string.find(id, '[:|,]') or redis.call('HEXISTS', jobs, id) == 0 then
    skipped = skipped + 1
  else
    local raw = redis.call('HGET', jobs, id)
    if not arrivals then arrivals = arrival_clock(queue_now(clock, stats)) end
    local m = parse_job(raw)
    local prio = (m and m.prio) or 1
    local arrival = arrivals.next()
    redis.call('HSET', jobs, id, format_job({prio = prio, arrival = arrival, deadline = 0,
                                             attempts = 0, keep = true, producer = '',
                                             cost = m and m.cost,
                                             requested = m and m.requested,
                                             envelope = m and m.envelope or raw}))
    redis.call('ZADD', pending[prio + 1], int(arrival), id)
    if not bounds then
      bounds = stored_bounds(policy)
      fair = fair_open(policy, fair_sets, fair_counters, fair_who)
    end
    list_waiting(costs, bucket_sets, bounds, id, m and m.cost or 1, arrival, prio)
    fair_list(fair, {{prio, job_tenant(raw), arrival, id}})
    redis.call('ZREM', dead, id)
    redis.call('HDEL', dead_reason, id)
    redis.call('DEL', KEYS[43 + i])
    local t = job_tenant(raw)
    if t then tally.add_tenant(t, 'w', 1) end
    done = done + 1
  end
end
if done > 0 then
  if action == 'retry' then
    arrivals.save()
    wake_consumers(marker)
    wake_buckets(bucket_markers, bucket_count(stored_bounds(policy)))
    redis.call('HINCRBY', stats, 'dead_retried', done)
    tally.flush(tenants)
  else
    redis.call('HINCRBY', stats, 'dead_purged', done)
  end
end
return {done, skipped}
