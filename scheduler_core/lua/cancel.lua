--[[ cancel: remove a waiting request so that it never runs.

KEYS[1..24] the queue's shared keys this script takes, in the order of
            scheduler_core.keys.SCRIPT_KEYS['cancel']:
KEYS[1]  {bg:q}:policy        hash  its result_ttl_s, when set, overrides ARGV[2];
                                    fairness
KEYS[2]  {bg:q}:pending:0     zset  HIGH
KEYS[3]  {bg:q}:pending:1     zset  NORMAL
KEYS[4]  {bg:q}:pending:2     zset  LOW
KEYS[5]  {bg:q}:jobs          hash  id -> "<meta>|<envelope>"
KEYS[6]  {bg:q}:costs         hash  id -> "<cost>:<bucket>:<prio>" while waiting
KEYS[7]  {bg:q}:stats         hash  counters
KEYS[8]  {bg:q}:owner         hash  id -> batch id while in flight
KEYS[9]  {bg:q}:deadlines     zset  pending id -> deadline (µs)
KEYS[10] {bg:q}:delayed       zset  past its deadline, waiting to run when idle
KEYS[11..15] {bg:q}:bucket:<1..5> zset  the ids waiting in each cost bucket: a cancelled one
                                  leaves the set its costs entry names
KEYS[16] {bg:q}:retry         zset  waiting for a retry (its backoff)
KEYS[17] {bg:q}:tenants     hash  per named tenant's counters (lua/_tenants.lua)
KEYS[18..20] {bg:q}:fair:<0..2> zset  fairness requests | cost (lua/_fair.lua): waiting
                                  requests by tenant, then arrival
KEYS[21..23] {bg:q}:vtc:<0..2> zset  the backlogged tenants of each level -> virtual counter
KEYS[24] {bg:q}:fair:who    hash  id -> tenant of each request in the fair sets
KEYS[25] {bg:q}:result:<id>   string, written if the request asked for it (keep)
KEYS[26] {bg:q}:inbox:<producer>  list, the producer's inbox (any key if none)

ARGV[1]  request id
ARGV[2]  result TTL, seconds, if the queue has no policy
ARGV[3]  the result envelope to store and deliver ('Cancelled' or 'DeadlineExceeded')
ARGV[4]  the stats counter to count it under ('cancelled' | 'expired')

Returns  1 cancelled (result delivered), 2 already in a batch (it will run),
         0 finished (it has a result, or it is dead-lettered, or results wait unread in
           the producer's inbox: one of them may be its own, not stored by id),
         3 unknown: not waiting, not in flight, no result, not dead-lettered, nothing in
           the inbox (Redis lost it, its result expired, or was delivered already)
Errors   {-3, field} malformed argument
]]
-- @include _common.lua
-- @include _tenants.lua
-- @include _fair.lua
-- @include _queue.lua

local policy = KEYS[1]
local pending_high = KEYS[2]
local pending_normal = KEYS[3]
local pending_low = KEYS[4]
local jobs = KEYS[5]
local costs = KEYS[6]
local stats = KEYS[7]
local owner = KEYS[8]
local deadlines = KEYS[9]
local delayed = KEYS[10]
local bucket_sets = {KEYS[11], KEYS[12], KEYS[13], KEYS[14], KEYS[15]}
local retry = KEYS[16]
local tenants = KEYS[17]
local fair_sets = {KEYS[18], KEYS[19], KEYS[20]}
local fair_counters = {KEYS[21], KEYS[22], KEYS[23]}
local fair_who = KEYS[24]
local result = KEYS[25]
local inbox = KEYS[26]

if ARGV[4] ~= 'cancelled' and ARGV[4] ~= 'expired' then return {-3, 'counter'} end
if not int_arg(ARGV[2], 1, 315360000) then return {-3, 'result_ttl_s'} end
if #ARGV ~= 4 or #KEYS ~= 26 then return {-3, 'args'} end
-- The queue's current result_ttl_s, as the consumers use it, not the caller's copy.
local ttl = int_arg(redis.call('HGET', policy, 'result_ttl_s'), 1, 315360000)
  or tonumber(ARGV[2])

local id, envelope, counter = ARGV[1], ARGV[3], ARGV[4]
if redis.call('HEXISTS', owner, id) == 1 then return 2 end
for level, pending in ipairs({pending_high, pending_normal, pending_low, delayed, retry}) do
  if redis.call('ZREM', pending, id) == 1 then
    redis.call('ZREM', deadlines, id)
    unlist_waiting(costs, bucket_sets, {id})
    local m = parse_job(redis.call('HGET', jobs, id))
    if level <= 3 then  -- out of the fair index (lua/_fair.lua), under fairness
      fair_unlist(fair_open(policy, fair_sets, fair_counters, fair_who),
                  {{level - 1, m and m.arrival or 0, id}})
    end
    redis.call('HDEL', jobs, id)
    if not m or m.keep then store_result(result, envelope, ttl) end
    if m and m.producer ~= '' then deliver_results(inbox, ttl, envelope) end
    redis.call('HINCRBY', stats, counter, 1)
    -- Tenants (lua/_tenants.lua): it no longer waits.
    if m then
      local t = envelope_tenant(m.envelope)
      if t then
        local tally = tenant_tally()
        tally.add_tenant(t, 'w', -1)
        tally.flush(tenants)
      end
    end
    return 1
  end
end
if not request_known(jobs, result, id) and redis.call('LLEN', inbox) == 0 then return 3 end
return 0
