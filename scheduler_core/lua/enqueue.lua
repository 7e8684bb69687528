--[[ enqueue: add N requests to a queue atomically (all or none).

KEYS[1..30] the queue's shared keys this script takes, in the order of
            scheduler_core.keys.SCRIPT_KEYS['enqueue']:
KEYS[1]  {bg:q}:policy      hash   read (one HMGET): strategy, max_batch_size,
                                   max_queue_size, max_cost, over_cost, max_batch_cost,
                                   cost_buckets, retired, fairness and the deadline policy
                                   (timeout_<level>_ms, allow_timeout_override, on_timeout)
KEYS[2]  {bg:q}:pending:0   zset   HIGH
KEYS[3]  {bg:q}:pending:1   zset   NORMAL
KEYS[4]  {bg:q}:pending:2   zset   LOW
KEYS[5]  {bg:q}:jobs        hash   id -> "<meta>|<envelope>" (_common.lua's format_job)
KEYS[6]  {bg:q}:costs       hash   id -> "<cost>:<bucket>:<prio>" of each new request (_queue.lua's
                                   cost_record): what a pop reads of it to learn its cost
KEYS[7]  {bg:q}:clock       string the queue's clock and last arrival score issued (queue_now)
KEYS[8]  {bg:q}:marker      zset   wake-up marker for idle consumers
KEYS[9]  {bg:q}:stats       hash   read on rejection: the recent service rate
KEYS[10] {bg:q}:deadlines   zset   id -> deadline (µs) of each new request that has one
KEYS[11] {bg:q}:arrivals    hash   epoch second (decimal string) -> requests enqueued in
                                   that second (scheduler_core/load.py reads the rate);
                                   fields older than ARRIVALS_KEEP_S are removed
KEYS[12..16] {bg:q}:marker:<1..5> zset  wake-up marker of the consumers dedicated to a cost
                                   bucket: set for each bucket a new request falls in
KEYS[17..21] {bg:q}:bucket:<1..5> zset  with cost buckets: each new request's id, in its
                                   bucket's set (score = arrival)
KEYS[22] {bg:q}:tenants     hash  per named tenant's counters (lua/_tenants.lua)
KEYS[23] {bg:q}:tenant_rate hash  per tenant's rate-quota token buckets
KEYS[24..26] {bg:q}:fair:<0..2> zset  fairness requests | cost (lua/_fair.lua): waiting
                                  requests by tenant, then arrival
KEYS[27..29] {bg:q}:vtc:<0..2> zset  the backlogged tenants of each level -> virtual counter
KEYS[30] {bg:q}:fair:who    hash  id -> tenant of each request in the fair sets
KEYS[31..] {bg:q}:idem:<key> string one per request whose idem flag is 1, in order
read, not passed: {bg:q}:result:<id> of the id an idempotency key names (the caller cannot
         know it; same hash tag, so the slot of the keys above)

ARGV[1]  producer id (owner of the inbox results go to; may be empty)
         ids: 1-128 characters from letters, digits, '_', '.', '-'
ARGV[2]  n, the number of requests (1..10000)
ARGV[3]  idempotency key TTL in seconds (1..315360000)
ARGV[4+7i..10+7i] for request i: id, priority (0|1|2), deadline_ms
         (0 = none, ..86400000), envelope bytes, idem flag (0|1), cost (1..1000000000),
         keep (0|1: 1 = its result is also stored by id, result:<id>, for fetch)
ARGV[4+7n] optional: 'trial', a producer's coalesced call that it sends again per
         submission if refused: a tenant quota's refusal is then not counted
Integer arguments are plain decimal digits ('1.5', 'nan', '1e3' are malformed).

Returns  {1, added, depth_after, id_1 .. id_n, deadline_ms_1 .. deadline_ms_n}
         deadline_ms_i: the deadline request i got, ms after its enqueue (0 = none; 0
         too where it was already queued): its own, or its level's default timeout
         (timeout_<level>_ms) where it gave none or allow_timeout_override is 0.
         id_i is the id now holding request
         i: its own, or the earlier request's id when its idempotency key was seen before
         and Redis still knows that request (waiting, in flight, dead-lettered, or with a
         result); a key whose request is gone (result expired, data lost) is taken over.
         An id that is already queued or in flight is not added again, so a client may
         resend an enqueue whose reply it lost.
Errors   {-1, depth, max_queue_size, adding, rate_mrps}  queue full, nothing written;
         depth counts waiting requests not yet past their deadline (an expired one
         never holds a place);
         rate_mrps: recent service rate (milli-requests/s; 0 = none measured lately)
         {-3, field}                          malformed argument, nothing written
         {-3, 'policy'}                       the stored deadline policy is outside the
                                              policy LIMITS
         {-4, 'cost', i, cost, max_cost}      request i (0-based) costs more than the
                                              policy's max_cost (over_cost=reject);
                                              nothing written. With over_cost=truncate its
                                              cost is capped to max_cost instead and the
                                              meta keeps the cost asked for
         {-3, 'keep'}                         keep is not 0 or 1
         {-6, tenant, limit, value, retry_after_ms}  the request(s) of named tenant
                                              `tenant` are over its quota `limit`
                                              (max_waiting, rps, cps, or burst /
                                              cost_burst: more in one call than the
                                              bucket holds) of `value` (docs/tenants.md);
                                              retry_after_ms: until enough tokens are
                                              back (0: none given). Nothing written but
                                              the tenant's refused counter and the
                                              queue's clock (the clock key)
         {-5, 'shards'}                       this queue is a shard that `policy set
                                              --shards` dropped (policy field retired):
                                              nothing written; place the requests on a
                                              shard of the current count

Arrival scores come from TIME and are strictly increasing per queue, so ties keep
arrival order. A consumer is woken when a new deadline is the queue's earliest, so that
an idle one re-arms its timer for it. Work is bounded by n; the writes are variadic
(one call per key and chunk of requests): a script's cost is mostly its redis.call()s.
]]
-- @include _common.lua
-- @include _policy.lua
-- @include _tenants.lua
-- @include _fair.lua
-- @include _queue.lua

local ARRIVALS_KEEP_S = 120
-- Variadic calls take at most CHUNK requests: unpack() of more would overflow Lua's stack.
local CHUNK = 1000

-- `command key` with the values of `list`, in calls of at most CHUNK pairs.
local function write_pairs(command, key, list)
  for first = 1, #list, 2 * CHUNK do
    redis.call(command, key, unpack(list, first, math.min(#list, first + 2 * CHUNK - 1)))
  end
end

-- Count `n` arrivals in the current second. The first call of a second also drops the
-- fields 121-130 s old (one HDEL); only after a long silence can older ones remain, and
-- once the hash has more fields than a window holds they are swept (bounded by that size).
local function count_arrivals(key, now, n)
  local second = math.floor(now / 1000000)
  if redis.call('HINCRBY', key, int(second), n) ~= n then return end
  local old = {}
  for age = ARRIVALS_KEEP_S + 1, ARRIVALS_KEEP_S + 10 do old[#old + 1] = int(second - age) end
  redis.call('HDEL', key, unpack(old))
  if redis.call('HLEN', key) > ARRIVALS_KEEP_S + 10 then
    for _, field in ipairs(redis.call('HKEYS', key)) do
      local s = tonumber(field)
      if not s or s < second - ARRIVALS_KEEP_S then redis.call('HDEL', key, field) end
    end
  end
end

local policy = KEYS[1]
local pending_high = KEYS[2]
local pending_normal = KEYS[3]
local pending_low = KEYS[4]
local jobs = KEYS[5]
local costs = KEYS[6]
local clock = KEYS[7]
local marker = KEYS[8]
local stats = KEYS[9]
local deadlines = KEYS[10]
local arrivals = KEYS[11]
local bucket_markers = {KEYS[12], KEYS[13], KEYS[14], KEYS[15], KEYS[16]}
local bucket_sets = {KEYS[17], KEYS[18], KEYS[19], KEYS[20], KEYS[21]}
local tenants = KEYS[22]
local tenant_rate = KEYS[23]
local fair_sets = {KEYS[24], KEYS[25], KEYS[26]}
local fair_counters = {KEYS[27], KEYS[28], KEYS[29]}
local fair_who = KEYS[30]
local FIRST_IDEM = 31  -- KEYS[31..]: the idempotency keys, in order

local n = int_arg(ARGV[2], 1, 10000)
if not n or (#ARGV ~= 3 + 7 * n and #ARGV ~= 4 + 7 * n) then return {-3, 'n'} end
-- A coalesced call the producer sends again per submission if refused (ARGV[4+7n]):
-- a tenant quota's refusal of it is not counted.
local trial = ARGV[4 + 7 * n] == 'trial'
if #ARGV == 4 + 7 * n and not trial then return {-3, 'trial'} end
local idem_ttl = int_arg(ARGV[3], 1, 315360000)
if not idem_ttl then return {-3, 'idempotency_ttl'} end
local producer = ARGV[1]
if producer ~= '' and not valid_id(producer) then return {-3, 'producer'} end

local rules = redis.call('HMGET', policy, 'strategy', 'max_batch_size', 'max_queue_size',
                         'max_cost', 'over_cost', 'max_batch_cost', 'cost_buckets', 'retired',
                         'fairness', unpack(TIMEOUT_FIELDS))  -- all it reads, at once
-- A dropped shard takes nothing more: no consumer will serve it.
if rules[8] == '1' then return {-5, 'shards'} end
local strategy = rules[1] or 'fifo'
local batch_size = tonumber(rules[2]) or 1
local limit = tonumber(rules[3]) or 0
local max_cost = tonumber(rules[4]) or 0  -- 0: no cap
local truncate = rules[5] == 'truncate'
-- With a cost budget or buckets, a new request may fill its bucket (by size or budget)
-- while the queue as a whole is far from max_batch_size: every arrival wakes a consumer.
local costed = (tonumber(rules[6]) or 0) > 0 or (rules[7] and rules[7] ~= '')
-- Malformed buckets read as none here: pop_batch refuses such a policy anyway.
local bounds = parse_buckets(rules[7]) or {}
local timeouts = timeouts_of(rules, 10)
if not timeouts then return {-3, 'policy'} end
local now = queue_now(clock, stats, true)  -- noted once it writes (pass 2)

local pending = {pending_high, pending_normal, pending_low}
local depth = {redis.call('ZCARD', pending_high), redis.call('ZCARD', pending_normal),
               redis.call('ZCARD', pending_low)}
local total = depth[1] + depth[2] + depth[3]

-- Pass 1: validate, resolve idempotency keys, count what is really new.
-- Which ids are already queued or in flight: one HMGET per chunk (a resent call's ids
-- are there; fresh ones read as nil).
local queued = {}
do
  local ids = {}
  for i = 0, n - 1 do ids[i + 1] = ARGV[4 + 7 * i] end
  for first = 1, n, CHUNK do
    local got = redis.call('HMGET', jobs, unpack(ids, first, math.min(n, first + CHUNK - 1)))
    for j = 1, #got do queued[first + j - 1] = got[j] ~= false end
  end
end
local effective, fresh, seen_keys = {}, 0, {}
local prios, deadlines_ms, asked = {}, {}, {}  -- per request, as validated: pass 2 reuses them
local key_index = FIRST_IDEM
for i = 0, n - 1 do
  local base = 4 + 7 * i
  local id, prio = ARGV[base], int_arg(ARGV[base + 1], 0, 2)
  local deadline_ms = int_arg(ARGV[base + 2], 0, 86400000)
  local cost = int_arg(ARGV[base + 5], 1, MAX_REQUEST_COST)
  if not valid_id(id) then return {-3, 'id'} end
  if not prio then return {-3, 'priority'} end
  if not deadline_ms then return {-3, 'deadline_ms'} end
  if not cost then return {-3, 'cost'} end
  prios[i + 1], deadlines_ms[i + 1], asked[i + 1] = prio, deadline_ms, cost
  if ARGV[base + 6] ~= '0' and ARGV[base + 6] ~= '1' then return {-3, 'keep'} end
  if max_cost > 0 and cost > max_cost and not truncate then
    return {-4, 'cost', i, cost, max_cost}
  end
  if ARGV[base + 4] ~= '0' and ARGV[base + 4] ~= '1' then return {-3, 'idempotency_key'} end
  local existing = false
  if ARGV[base + 4] == '1' then
    local key = KEYS[key_index]
    key_index = key_index + 1
    if not key then return {-3, 'idempotency_key'} end
    existing = seen_keys[key]
    if not existing then
      existing = redis.call('GET', key)
      -- A key whose request Redis no longer knows (its result expired, or Redis lost
      -- it) is free: the resubmission runs again instead of following a request that
      -- will never answer.
      if existing and not request_known(jobs, result_key_of(policy, existing), existing) then
        existing = false
      end
      if not existing then seen_keys[key] = id end
    end
  end
  if not existing and queued[i + 1] then existing = id end
  if existing then
    effective[i + 1] = existing
  else
    effective[i + 1] = false
    fresh = fresh + 1
  end
end
-- Tenants (lua/_tenants.lua): each new request's tenant, and the quotas of the named
-- ones, checked before the queue's own limit. Nothing of a refused call is written; only
-- its tenant's refused counter (r:<tenant>) is raised.
local tenant_counts, tenant_rates = tenants, tenant_rate
local tenant_new, tenant_names = {}, {}  -- tenant -> {count, cost} of its new requests
for i = 1, n do
  if not effective[i] then
    local t = envelope_tenant(ARGV[4 + 7 * (i - 1) + 3])
    if t == false then return {-3, 'tenant'} end
    if t then
      local g = tenant_new[t]
      if not g then
        g = {count = 0, cost = 0}
        tenant_new[t] = g
        tenant_names[#tenant_names + 1] = t
      end
      g.count = g.count + 1
      g.cost = g.cost + math.min(asked[i], max_cost > 0 and max_cost or asked[i])
    end
  end
end
local tenant_buckets = {}  -- field -> token bucket state to save once accepted
if #tenant_names > 0 then
  local quotas = redis.call('HGET', policy, 'tenant_quotas')
  for _, t in ipairs(tenant_names) do
    local q, g = tenant_quota(quotas, t), tenant_new[t]
    local refused = nil
    if (q.max_waiting or 0) > 0 then
      local waiting = tonumber(tenant_get(tenant_counts, 'w:' .. t)) or 0
      if waiting + g.count > q.max_waiting then
        refused = {'max_waiting', q.max_waiting, 0}
      end
    end
    for _, b in ipairs({{'rps', 'burst', 'q:', g.count}, {'cps', 'cost_burst', 'c:', g.cost}}) do
      local rate = q[b[1]] or 0
      if not refused and rate > 0 then
        local burst = q[b[2]] or 0
        if burst <= 0 then burst = math.max(rate, 1) end
        if b[4] > burst then
          refused = {b[2], burst, 0}
        else
          local ok, state, wait = take_tokens(tenant_rates, b[3] .. t, rate, burst, b[4], now)
          if ok then tenant_buckets[b[3] .. t] = state else refused = {b[1], rate, wait} end
        end
      end
    end
    if refused then
      if not trial then
        local tally = tenant_tally()
        tally.add_tenant(t, 'r', g.count)
        tally.flush(tenant_counts)
      end
      -- The queue's clock noted: else, after a backward step of TIME, a tenant refused in
      -- a loop would read the same time each call and its bucket would never refill.
      note_clock()
      return {-6, t, refused[1], refused[2], int(math.ceil(refused[3] * 1000))}
    end
  end
end
-- Requests past their deadline hold no place: they leave at once (expire_due.lua).
local live = total
if limit > 0 and total + fresh > limit then
  live = total - redis.call('ZCOUNT', deadlines, '-inf', int(now))
end
if limit > 0 and live + fresh > limit then
  -- The rate complete.lua measured, decayed when no window has closed for over 2 s
  -- (consumers stalled or gone): then it is at most what was processed since / time since.
  local r = redis.call('HMGET', stats, 'rate_mrps', 'rate_since_us', 'rate_base', 'processed')
  local rate = tonumber(r[1]) or 0
  local since, base = read_rate_window(r[2], r[3])
  local idle = since and (now - since) or 0
  if idle > 2000000 then
    rate = math.min(rate, math.max(0, (tonumber(r[4]) or 0) - base) * 1e9 / idle)
  end
  return {-1, live, limit, fresh, int(rate)}
end

-- Pass 2: write.
-- (The queue's clock is written with the arrival scores, scores.save().)
local first_deadline = nil  -- the queue's earliest deadline, read at the first new one
local given = {}  -- the deadline each request got, ms
local scores = arrival_clock(now)
local wake = (strategy == 'fifo') or costed
local pending_adds, job_fields, deadline_adds = {{}, {}, {}}, {}, {}
local bucket_adds = {}  -- bucket -> {arrival, id, ...} of its new requests
local fair = fair_index(rules[9], fair_sets, fair_counters, fair_who)
local fair_adds = {}  -- {level, tenant, arrival, id} of each new request, under fairness
local cost_fields = {}  -- id, cost_record, ...: beside jobs, so that a pop reads no payload
key_index = FIRST_IDEM
for i = 0, n - 1 do
  local base = 4 + 7 * i
  local id, prio, deadline_ms = ARGV[base], prios[i + 1], deadlines_ms[i + 1]
  local requested = asked[i + 1]
  local cost = requested
  if max_cost > 0 and cost > max_cost then cost = max_cost end  -- truncate (checked above)
  local idem_key = nil
  if ARGV[base + 4] == '1' then
    idem_key = KEYS[key_index]
    key_index = key_index + 1
  end
  if not effective[i + 1] then
    local arrival = scores.next()
    local arrival_s = int(arrival)
    local default = timeouts.levels[prio + 1]
    if default > 0 and (deadline_ms == 0 or timeouts.override == 0) then
      deadline_ms = default
    end
    given[i + 1] = deadline_ms
    local deadline = 0
    if deadline_ms > 0 then
      deadline = now + deadline_ms * 1000
      deadline_adds[#deadline_adds + 1] = int(deadline)
      deadline_adds[#deadline_adds + 1] = id
      -- The queue's earliest deadline: an idle consumer re-arms its timer for it.
      if not first_deadline then
        local first = redis.call('ZRANGE', deadlines, 0, 0, 'WITHSCORES')[2]
        first_deadline = first and tonumber(first) or math.huge
      end
      if deadline < first_deadline then
        first_deadline, wake = deadline, true
      end
    end
    local adds = pending_adds[prio + 1]
    adds[#adds + 1] = arrival_s
    adds[#adds + 1] = id
    job_fields[#job_fields + 1] = id
    job_fields[#job_fields + 1] = format_job({prio = prio, arrival_s = arrival_s,
      deadline = deadline, attempts = 0, keep = ARGV[base + 6] == '1', producer = producer,
      cost = cost, requested = requested, envelope = ARGV[base + 3]})
    if idem_key then redis.call('SET', idem_key, id, 'EX', idem_ttl) end  -- free or stale
    effective[i + 1] = id
    -- Wake an idle consumer only when its next decision may have changed: the request
    -- is due at once (HIGH, or LOW with nothing ahead), it fills a batch, or it is the
    -- first to wait (a new due time). Otherwise a sleeping consumer's timer stands.
    if strategy == 'dynamic' then
      if total == 0 or total + 1 >= batch_size then wake = true end
    elseif strategy == 'priority' then
      if prio == 0 or depth[prio + 1] == 0 or depth[prio + 1] + 1 >= batch_size
         or (prio == 2 and depth[1] + depth[2] == 0) then wake = true end
    end
    local b = 0
    if #bounds > 0 then
      b = bucket_of(bounds, cost)
      bucket_adds[b] = bucket_adds[b] or {}
      table.insert(bucket_adds[b], arrival_s)
      table.insert(bucket_adds[b], id)
    end
    if fair then
      fair_adds[#fair_adds + 1] = {prio, envelope_tenant(ARGV[base + 3]), arrival, id}
    end
    cost_fields[#cost_fields + 1] = id
    cost_fields[#cost_fields + 1] = cost_record(cost, b, prio)
    depth[prio + 1] = depth[prio + 1] + 1
    total = total + 1
  end
end
for level = 1, 3 do write_pairs('ZADD', pending[level], pending_adds[level]) end
write_pairs('HSET', jobs, job_fields)
write_pairs('HSET', costs, cost_fields)
write_pairs('ZADD', deadlines, deadline_adds)
fair_list(fair, fair_adds)
scores.save()
if wake then wake_consumers(marker) end
for b, adds in pairs(bucket_adds) do
  write_pairs('ZADD', bucket_sets[b], adds)
  wake_bucket(bucket_markers, b)
end
-- Tenants: the accepted requests count as waiting; their rate quotas' tokens are taken.
if #tenant_names > 0 then
  local tally = tenant_tally()
  for _, t in ipairs(tenant_names) do
    tally.add_tenant(t, 'w', tenant_new[t].count)
    tally.add_tenant(t, 'a', tenant_new[t].count)
  end
  tally.flush(tenant_counts)
  for field, state in pairs(tenant_buckets) do redis.pcall('HSET', tenant_rates, field, state) end
end
-- Counted by TIME's second (the queue's clock less its offset), as
-- scheduler_core/load.py reads them back.
if fresh > 0 then count_arrivals(arrivals, now - clock_now.offset, fresh) end

local reply = {1, fresh, total}
for i = 1, n do reply[#reply + 1] = effective[i] end
for i = 1, n do reply[#reply + 1] = given[i] or 0 end
return reply
