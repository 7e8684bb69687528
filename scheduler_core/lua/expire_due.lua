--[[ expire_due: take the waiting requests whose deadline has passed out of the queue.

Called in two steps, so that every key it writes is passed in KEYS: 'list' names the due
requests (and, under on_timeout = delay, moves them to the delayed set itself: that needs
no per-call key); 'expire' answers those listed with their DeadlineExceeded envelope,
pushed to the producer's inbox (and stored under result:<id> if the request asked for
it) as cancel.lua and complete.lua do. A request is answered only while it still waits past its deadline, so
of several callers (consumers, their lease threads, producers) exactly one delivers it.

KEYS[1..43] the queue's shared keys, in the order of scheduler_core.keys.SHARED_KEYS;
            this script uses:
KEYS[1]  {bg:q}:policy      hash  on_timeout, result_ttl_s, cost_buckets
KEYS[2]  {bg:q}:pending:0   zset  HIGH
KEYS[3]  {bg:q}:pending:1   zset  NORMAL
KEYS[4]  {bg:q}:pending:2   zset  LOW
KEYS[5]  {bg:q}:jobs        hash  id -> "<meta>|<envelope>" (deadline cleared when delayed)
KEYS[6]  {bg:q}:costs       hash  id -> "<cost>:<bucket>:<prio>" while waiting: an expired one's
                                  entry goes (a delayed one still waits: it keeps it)
KEYS[7]  {bg:q}:clock       string last arrival score issued (the queue's clock: queue_now)
KEYS[8]  {bg:q}:marker      zset  wake-up marker (a delayed request may be due at once)
KEYS[9]  {bg:q}:stats       hash  counters: expired, delayed; the queue's clock
KEYS[20] {bg:q}:deadlines   zset  pending id -> deadline (µs)
KEYS[21] {bg:q}:delayed     zset  id -> arrival (µs): past its deadline, runs when idle
KEYS[24..28] {bg:q}:marker:<1..5> zset  wake-up markers of consumers dedicated to a cost bucket
KEYS[29..33] {bg:q}:bucket:<1..5> zset  the ids waiting in each cost bucket: an expired one
                                  leaves the set its costs entry names
KEYS[35] {bg:q}:tenants     hash  per named tenant's counters (lua/_tenants.lua)
KEYS[37..39] {bg:q}:fair:<0..2> zset  fairness requests | cost (lua/_fair.lua): waiting
                                  requests by tenant, then arrival
KEYS[40..42] {bg:q}:vtc:<0..2> zset  the backlogged tenants of each level -> virtual counter
KEYS[43] {bg:q}:fair:who    hash  id -> tenant of each request in the fair sets
KEYS[44+2i] {bg:q}:result:<id_i>       ('expire' only) result of listed request i
KEYS[45+2i] {bg:q}:inbox:<producer_i>  ('expire' only) its producer's inbox (any key if
            it has none)

ARGV[1]  mode: 'list' | 'expire'
list:    ARGV[2] limit, the most requests to list or delay (1..1000)
expire:  ARGV[2] result TTL, seconds, if the queue has no policy (1..315360000)
         ARGV[3] n (1..1000); ARGV[4+2i], ARGV[5+2i] for request i: id, result envelope

Returns  list:   {now_us, next_deadline_us, delayed, id_1, producer_1, ...}: the due
                 requests to expire (at most limit; none under on_timeout = delay, which
                 moves up to limit of them to the delayed set: `delayed`);
                 next_deadline_us: the earliest deadline still waiting, -1 if none
         expire: {expired, next_deadline_us, due_left}: requests answered (the others
                 listed were cancelled, popped or answered meanwhile); due_left: 1 if
                 more requests are past their deadline (call again), else 0
Errors   {-3, field} malformed argument, or {-3, 'policy'}: the stored deadline policy is
         outside the policy LIMITS; nothing written

Work is bounded by limit (list) and n (expire).
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
local deadlines = KEYS[20]
local delayed = KEYS[21]
local bucket_markers = {KEYS[24], KEYS[25], KEYS[26], KEYS[27], KEYS[28]}
local bucket_sets = {KEYS[29], KEYS[30], KEYS[31], KEYS[32], KEYS[33]}
local tenants = KEYS[35]
local fair_sets = {KEYS[37], KEYS[38], KEYS[39]}
local fair_counters = {KEYS[40], KEYS[41], KEYS[42]}
local fair_who = KEYS[43]
local pending = {pending_high, pending_normal, pending_low}
-- The fair index (lua/_fair.lua) under fairness requests | cost, read once; nil: none.
local fair = nil

-- Take `id` (parsed jobs value `m`) out of whichever level holds it (aging may have moved
-- it), and out of the fair index; false if none.
local function unqueue(id, m)
  for level, key in ipairs(pending) do
    if redis.call('ZREM', key, id) == 1 then
      if fair == nil then fair = fair_open(policy, fair_sets, fair_counters, fair_who) or false end
      fair_unlist(fair or nil, {{level - 1, m and m.arrival or 0, id}})
      return true
    end
  end
  return false
end

-- on_timeout = delay: the request stays, in the delayed set, without its deadline.
local function delay(id, now)
  local m = parse_job(redis.call('HGET', jobs, id))
  redis.call('ZREM', deadlines, id)
  if not unqueue(id, m) then return false end
  local arrival = now
  if m then
    arrival = m.arrival
    m.deadline, m.deadline_s = 0, nil
    redis.call('HSET', jobs, id, format_job(m))
  end
  redis.call('ZADD', delayed, int(arrival), id)
  return true
end

local function next_deadline()
  local first = redis.call('ZRANGE', deadlines, 0, 0, 'WITHSCORES')
  if first[1] then return first[2] end
  return -1
end

local mode = ARGV[1]
if mode ~= 'list' and mode ~= 'expire' then return {-3, 'mode'} end
local timeouts = read_timeouts(policy)
if not timeouts then return {-3, 'policy'} end
local now = queue_now(clock, stats, true)  -- noted once the arguments are checked

if mode == 'list' then
  local limit = int_arg(ARGV[2], 1, 1000)
  if not limit or #ARGV ~= 2 then return {-3, 'limit'} end
  note_clock()
  local due = redis.call('ZRANGEBYSCORE', deadlines, '-inf', int(now), 'LIMIT', 0, limit)
  local reply = {int(now), 0, 0}
  if timeouts.on_timeout == 'delay' then
    local moved = 0
    for _, id in ipairs(due) do
      if delay(id, now) then moved = moved + 1 end
    end
    if moved > 0 then
      redis.call('HINCRBY', stats, 'delayed', moved)
      wake_consumers(marker)
      wake_buckets(bucket_markers, bucket_count(stored_bounds(policy)))
    end
    reply[3] = moved
  elseif #due > 0 then
    local raw = redis.call('HMGET', jobs, unpack(due))
    for i, id in ipairs(due) do
      local m = parse_job(raw[i])
      reply[#reply + 1] = id
      reply[#reply + 1] = m and m.producer or ''
    end
  end
  reply[2] = next_deadline()
  return reply
end

local ttl_arg = int_arg(ARGV[2], 1, 315360000)
if not ttl_arg then return {-3, 'result_ttl_s'} end
local n = int_arg(ARGV[3], 1, 1000)
if not n or #ARGV ~= 3 + 2 * n or #KEYS ~= 43 + 2 * n then return {-3, 'n'} end
note_clock()
-- The queue's current result_ttl_s, as the consumers use it, not the caller's copy.
local ttl = int_arg(redis.call('HGET', policy, 'result_ttl_s'), 1, 315360000) or ttl_arg
local expired, moved = 0, 0
local tally = tenant_tally()  -- tenants (lua/_tenants.lua): the expired no longer wait
for i = 0, n - 1 do
  local id, envelope = ARGV[4 + 2 * i], ARGV[5 + 2 * i]
  local deadline = tonumber(redis.call('ZSCORE', deadlines, id))
  if deadline and deadline <= now then
    if timeouts.on_timeout == 'delay' then  -- changed since the list
      if delay(id, now) then moved = moved + 1 end
    else
      local m = parse_job(redis.call('HGET', jobs, id))
      redis.call('ZREM', deadlines, id)
      if unqueue(id, m) then
        unlist_waiting(costs, bucket_sets, {id})
        redis.call('HDEL', jobs, id)
        if not m or m.keep then store_result(KEYS[44 + 2 * i], envelope, ttl) end
        if m and m.producer ~= '' then deliver_results(KEYS[45 + 2 * i], ttl, envelope) end
        expired = expired + 1
        local t = m and envelope_tenant(m.envelope)
        if t then tally.add_tenant(t, 'w', -1) end
      end
    end
  end
end
if expired > 0 then
  redis.call('HINCRBY', stats, 'expired', expired)
  tally.flush(tenants)
end
if moved > 0 then
  redis.call('HINCRBY', stats, 'delayed', moved)
  wake_consumers(marker)
  wake_buckets(bucket_markers, bucket_count(stored_bounds(policy)))
end
local left = redis.call('ZRANGEBYSCORE', deadlines, '-inf', int(now), 'LIMIT', 0, 1)
return {expired, next_deadline(), #left}
