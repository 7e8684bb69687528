--[[ pop_batch: apply the queue's strategy and, if a batch is due, move it in flight.

This is where the scheduling rules live (docs/scheduling.md explains them):
  fifo      oldest requests across all priorities, up to max_batch_size, never waits.
  dynamic   oldest across all priorities; released when max_batch_size wait, or when the
            oldest has waited max_queue_delay_ms; never earlier.
  priority  HIGH waiting -> up to max_batch_size HIGH at once, no waiting;
            else NORMAL waiting -> the dynamic rule on NORMAL (nothing while not due);
            else LOW -> up to max_batch_size LOW.
            Aging: a request that has waited aging_ms moves up one level, 2 x aging_ms two
            levels, so NORMAL and LOW are served even under sustained HIGH load.
  costs     (policy max_batch_cost > 0 or cost_buckets set; see pick_costed) wherever a
            rule above takes requests, it takes them from one cost bucket only, within
            the batch's cost budget; where it waits for a batch to fill (dynamic, NORMAL),
            a bucket is released when full (max_batch_size, or its budget) or when its
            oldest request has waited max_queue_delay_ms: the due bucket whose oldest
            request is oldest goes first, unless the consumer prefers a bucket (ARGV[3])
            and that bucket is due (or, where the rule takes at once, waits at all).
  dedicated (ARGV[3] < 0: a consumer that serves one bucket only) the rules above,
            applied to that bucket's requests alone, as if they were the whole queue: the
            oldest `window` of its bucket set, wherever they wait (read_views). Without
            cost_buckets, bucket 1 is every request and no other bucket has any.
fairness  (policy fairness requests | cost, lua/_fair.lua) wherever a rule above takes
            requests of a level, it takes them in fair order: each next one the oldest of
            the tenant with the lowest virtual counter at that level (weighted service,
            raised at commit); a tenant at its max_in_flight is passed over, and if every
            one waiting is, the reply is {0, -1}. The delayed set and a dedicated
            consumer's view keep arrival order. docs/tenants.md, "Fair share".
Deadlines: while any waiting request is past its deadline the reply is {-4}: the caller
            takes them out with expire_due.lua and pops again, so an expired request never
            fills or joins a batch. A wait ends no later than the earliest deadline.
Retries:   requests whose model raised a retry_on exception wait in the retry set
            (complete.lua) until their backoff, or their deadline, passes; each pop first
            moves up to max_batch_size due ones back to their level, under their arrival
            score, and a wait ends no later than the next one falls due.
Delayed:   requests past their deadline under on_timeout = delay (expire_due.lua moved
            them) run only when no level has a request waiting: up to max_batch_size of
            them, oldest first (with costs, by pick_costed's rule), as level 3.

KEYS[1..43] the queue's shared keys, in the order of scheduler_core.keys.SHARED_KEYS;
            this script uses:
KEYS[1]  {bg:q}:policy      hash  read; each field within policy LIMITS
KEYS[2]  {bg:q}:pending:0   zset  HIGH    (score = arrival, µs)
KEYS[3]  {bg:q}:pending:1   zset  NORMAL
KEYS[4]  {bg:q}:pending:2   zset  LOW
KEYS[5]  {bg:q}:jobs        hash  id -> "<meta>|<envelope>" (read only: the delivery in
                                  progress is the stored attempts + 1)
KEYS[6]  {bg:q}:costs       hash  id -> "<cost>:<bucket>:<prio>" of each waiting request: the
                                  costs a pop reads (never the payload); a batch's
                                  entries go. An id without one (listed by an older
                                  version) is read from jobs. Its RELIST field, while
                                  set, is the cursor of relist_step
KEYS[7]  {bg:q}:clock       string last arrival score issued (the queue's clock: queue_now)
KEYS[8]  {bg:q}:marker      zset  wake-up marker
KEYS[9]  {bg:q}:stats       hash  counters (the queue's clock is the clock key's)
KEYS[10] {bg:q}:inflight    zset  batch id -> lease deadline (µs)
KEYS[11] {bg:q}:owner       hash  id -> batch id
KEYS[12] {bg:q}:batches     hash  batch id -> "consumer|ids"
KEYS[13] {bg:q}:seq         string batch id counter
KEYS[14] {bg:q}:consumers   zset  consumer -> last heartbeat (µs)
KEYS[15] {bg:q}:dead        zset  dead-lettered id -> time (µs)
KEYS[16] {bg:q}:dead:reason hash  dead-lettered id -> error envelope
KEYS[17] {bg:q}:samples:wait list recent queue waits (µs), capped
KEYS[20] {bg:q}:deadlines   zset  pending id -> deadline (µs); popped ids leave it
KEYS[21] {bg:q}:delayed     zset  id -> arrival (µs), past its deadline, runs when idle
KEYS[24..28] {bg:q}:marker:<1..5> zset  wake-up markers of the consumers dedicated to a
                                  cost bucket (set, with cost buckets, as the marker is)
KEYS[29..33] {bg:q}:bucket:<1..5> zset  the ids waiting in each cost bucket (score =
                                  arrival): a batch leaves the sets its costs entries name;
                                  a dedicated consumer reads its own, drops the ids no
                                  longer waiting (left by an older version) and moves
                                  those listed under an older cost_buckets to their
                                  bucket's; the sets beyond the bucket count are
                                  emptied, SWEEP_STEP ids a pop (sweep_extra_sets)
KEYS[34] {bg:q}:retry       zset  id -> when it may run again (µs): due ones leave it
KEYS[35] {bg:q}:tenants     hash  per named tenant's counters (lua/_tenants.lua); under
                                  fairness, its in-flight counts (max_in_flight)
KEYS[37..39] {bg:q}:fair:<0..2> zset  fairness requests | cost (lua/_fair.lua): each level's
                                  waiting requests by tenant, then arrival
KEYS[40..42] {bg:q}:vtc:<0..2> zset  the backlogged tenants of each level -> virtual counter
KEYS[43] {bg:q}:fair:who    hash  id -> tenant of each request in the fair sets

ARGV[1]  consumer name (no '|')
ARGV[2]  lease in ms (100..86400000)
ARGV[3]  optional: this consumer's cost bucket, 1-based (1 = the cheapest): N > 0 it
         prefers bucket N, -N it serves bucket N only; 0 or absent = none. Preference is
         ignored without cost_buckets; without them every request is in bucket 1
         (-(MAX_COST_BUCKETS + 1)..MAX_COST_BUCKETS + 1)
ARGV[4]  optional: the max_queue_delay_ms to apply instead of the stored one (within its
         LIMITS): the delay a consumer derived under delay_mode=auto

Returns  {batch_id, now_us, lease_deadline_us, remaining, then per request 5 values:
          id, jobs value, attempt (this delivery, 1-based), state, level (0-2, or 3: from
          the delayed set)}
         remaining: requests still pending after this batch (all priorities and the
         delayed ones); a
         consumer fetches its next batch while the model runs only when it is > 0
         jobs value: "<meta>|<envelope>" as stored (format_job), whose meta gives the
         arrival, producer, cost (capped to max_cost under over_cost=truncate) and the
         cost asked for: the consumer splits it (wire.delivered_job), so that this script
         copies no envelope. A member without readable meta (written by hand) gets one
         made here, its whole value as the envelope and every attempt used
         state: 'run' | 'expired' (deadline passed: do not run) |
                'exhausted' (max_attempts deliveries used: dead-letter it)
         {0, wait_us}  nothing due; µs until the next request falls due or the earliest
               deadline passes, -1 if none; 0 (pop again at once) where a dedicated
               consumer's read of its bucket's set stopped at STALE_BUDGET dead ids, or
               relist_step is not through
         {-4}  a waiting request is past its deadline: run expire_due.lua, then pop again
               (nothing written but the heartbeat)
Errors   {-1}  queue has no policy (no consumer configured it yet)
         {-3, field} malformed argument, or {-3, 'policy'}: the stored policy is unreadable
               or outside the policy LIMITS; nothing written

A request delivered before (its batch was re-queued after a crash or hang) is returned
in a batch of its own, so that a poison payload fails alone. A member whose id no producer
makes (written by hand) is dead-lettered here, never delivered; if that leaves nothing,
the reply is {0, 0} (pop again at once).
Work is bounded: at most 2 x max_batch_size promotions, max_batch_size retries moved
back and max_batch_size pops per call;
with costs, at most (buckets x max_batch_size) requests read per level (at most 5 x 4096):
from the bucket sets (pick_from_sets: the groups it looks at, and at most twice the
window of ids of other levels passed over) or else the window;
a dedicated consumer reads as many of its bucket's set, and their levels (ZMSCORE), plus
at most STALE_BUDGET ids no longer waiting. Costs come from the costs hash, and aging's
submitted priorities too: a pop's work does not grow with payload size (it reads the
payloads of its batch only).
The body runs as named steps: read_policy, past_deadline, relist_step (after a
cost_buckets change: at most RELIST_STEP costs entries), sweep_extra_sets (at most
SWEEP_STEP ids of the sets beyond the bucket count), promote_aged, read_views (a
dedicated consumer), choose (pick_costed when costs are on) or take_delayed,
drop_malformed, isolate_retried, commit.
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
local seq = KEYS[13]
local consumers = KEYS[14]
local dead = KEYS[15]
local dead_reason = KEYS[16]
local wait_samples = KEYS[17]
local deadlines = KEYS[20]
local delayed = KEYS[21]
local bucket_markers = {KEYS[24], KEYS[25], KEYS[26], KEYS[27], KEYS[28]}
local bucket_sets = {KEYS[29], KEYS[30], KEYS[31], KEYS[32], KEYS[33]}
local retry = KEYS[34]
local tenants = KEYS[35]
local fair_sets = {KEYS[37], KEYS[38], KEYS[39]}
local fair_counters = {KEYS[40], KEYS[41], KEYS[42]}
local fair_who = KEYS[43]

local pending = {pending_high, pending_normal, pending_low, delayed}  -- by level + 1
-- The fair index (lua/_fair.lua) under fairness requests | cost; nil under none.
local fair = nil

-- The cost settings (absent in a policy stored before them: off) into `rules`: budget
-- (max_batch_cost, 0 = none), padded (cost_mode), bounds (cost_buckets), costed (any of
-- them on) and window (requests read per level: one max_batch_size per bucket, so that
-- whenever the window holds max_batch_size of some bucket that bucket is seen full).
-- False if a stored value is malformed.
local function read_cost_rules(rules, budget, mode, buckets)
  rules.budget = budget and policy_int('max_batch_cost', budget)
  rules.bounds = parse_buckets(buckets)
  if (budget and not rules.budget) or not rules.bounds
     or (mode and mode ~= 'sum' and mode ~= 'padded') then  -- CHOICES.cost_mode, no table
    return false
  end
  rules.budget, rules.padded = rules.budget or 0, mode == 'padded'
  rules.costed = rules.budget > 0 or #rules.bounds > 0
  rules.window = rules.batch_size * (#rules.bounds + 1)
  return true
end

-- The stored policy's rules (times in µs), or nil and the error reply.
local function read_policy()
  local p = redis.call('HMGET', policy, 'strategy', 'max_batch_size', 'max_queue_delay_ms',
                       'aging_ms', 'max_attempts', 'max_batch_cost', 'cost_mode',
                       'cost_buckets', 'retry_max', 'fairness')
  if not p[1] then return nil, {-1} end
  local rules = {strategy = p[1], batch_size = policy_int('max_batch_size', p[2]),
                 delay = policy_int('max_queue_delay_ms', p[3]),
                 aging = policy_int('aging_ms', p[4]),
                 max_attempts = policy_int('max_attempts', p[5])}
  if not (rules.batch_size and rules.delay and rules.aging and rules.max_attempts)
     or not STRATEGIES[rules.strategy] or not read_cost_rules(rules, p[6], p[7], p[8]) then
    return nil, {-3, 'policy'}  -- altered by hand: nothing written
  end
  rules.delay, rules.aging = rules.delay * 1000, rules.aging * 1000
  -- A retried run counts as a delivery: retry_max runs must fit (absent: 1, no retries).
  rules.max_attempts = math.max(rules.max_attempts, policy_int('retry_max', p[9]) or 1)
  rules.fairness = p[10]
  return rules
end

local function move(from, to, id, score)
  redis.call('ZREM', pending[from + 1], id)
  redis.call('ZADD', pending[to + 1], score, id)
  fair_move(fair, from, to, id, score)
end

-- Aging (priority only): level = original priority - floor(wait / aging_ms).
local function promote_aged(rules, now)
  local aging, limit = rules.aging, 2 * rules.batch_size
  local low = redis.call('ZRANGEBYSCORE', pending_low, '-inf', int(now - aging),
                         'WITHSCORES', 'LIMIT', 0, limit)
  for i = 1, #low, 2 do move(2, 1, low[i], low[i + 1]) end
  local twice = redis.call('ZRANGEBYSCORE', pending_normal, '-inf', int(now - 2 * aging),
                           'WITHSCORES', 'LIMIT', 0, limit)
  for i = 1, #twice, 2 do move(1, 0, twice[i], twice[i + 1]) end
  local once = redis.call('ZRANGEBYSCORE', pending_normal, '(' .. int(now - 2 * aging),
                          int(now - aging), 'WITHSCORES', 'LIMIT', 0, limit)
  if #once == 0 then return end
  -- Those submitted LOW stay: the priority from the costs entries, never from the jobs
  -- values (payloads); from those only where an older version wrote the entry.
  local ids = {}
  for i = 1, #once, 2 do ids[#ids + 1] = once[i] end
  local entries = read_in_chunks('HMGET', costs, ids)
  for k, id in ipairs(ids) do
    local prio = select(3, read_cost_record(entries[k]))
    if not prio then
      local m = parse_job(redis.call('HGET', jobs, id))
      prio = m and m.prio or 0
    end
    if prio <= 1 then move(1, 0, id, once[2 * k]) end
  end
end

-- A dedicated consumer's view of the queue (nil for any other): per level + 1, its
-- bucket's oldest `window` requests that wait there, {id, score, ...} in arrival order;
-- view_costs: id -> cost of each.
local views, view_costs = nil, nil

-- The costs entries of requests `ids` (a list): HMGET, or all of costs at once where it is
-- a listpack (a small hash: up to hash-max-listpack-entries, 512 by default), in which
-- each field HMGET looks up is a scan of the whole hash.
local function cost_entries(ids)
  if redis.call('OBJECT', 'ENCODING', costs) ~= 'listpack'
     or redis.call('HLEN', costs) > 16 * #ids then
    return read_in_chunks('HMGET', costs, ids)
  end
  local all, by_id, raw = redis.call('HGETALL', costs), {}, {}
  for k = 1, #all, 2 do by_id[all[k]] = all[k + 1] end
  for i, id in ipairs(ids) do raw[i] = by_id[id] or false end
  return raw
end

-- The costs of requests `ids` (a list, by index) and the bucket set each is listed in:
-- from their costs entries; for one without (listed by an older version) its cost from
-- its jobs value and its set nil.
local function read_costs(ids)
  local cost_of, set_of, prio_of, missing = {}, {}, {}, {}
  if #ids == 0 then return cost_of, set_of, prio_of end
  local raw = cost_entries(ids)
  for i = 1, #ids do
    local v = raw[i]
    local r = v and RECORDS[v]  -- read_cost_record's memo, looked up here: one call less
    if r == nil and v then
      read_cost_record(v)
      r = RECORDS[v]
    end
    if r then
      cost_of[i], set_of[i], prio_of[i] = r[1], r[2], r[3]
    else
      missing[#missing + 1] = ids[i]
    end
  end
  if #missing > 0 then
    local values, j = read_in_chunks('HMGET', jobs, missing), 0
    for i = 1, #ids do
      if not cost_of[i] then
        j = j + 1
        cost_of[i] = select(3, pop_fields(values[j])) or 1
      end
    end
  end
  return cost_of, set_of, prio_of
end

-- Ids of its bucket's set a dedicated pop reads beyond its window, at most, when it meets
-- ids that wait nowhere (bounded work per call; the next pop goes on at once).
local STALE_BUDGET = 1024

-- Read the view from the bucket's set; returns the requests in view per level + 1, and
-- whether the read stopped at STALE_BUDGET with ids left unread. Ids that wait nowhere
-- now (left by an older version, which kept cancelled and expired ids) leave the set;
-- one whose cost is of another bucket (listed under an older cost_buckets) moves to that
-- bucket's set, and its costs entry says so.
local function read_views(rules)
  views, view_costs = {{}, {}, {}, {}}, {}
  local counts = {0, 0, 0, 0}
  local set = bucket_sets[rules.only]
  local kept, read = 0, 0  -- ids in view (they stay in the set), ids read
  while kept < rules.window do
    local n = math.min(rules.window - kept, rules.window + STALE_BUDGET - read)
    if n <= 0 then return counts, true end
    local items = redis.call('ZRANGE', set, kept, kept + n - 1, 'WITHSCORES')
    if #items == 0 then break end
    local ids, live, at = {}, {}, {}
    for i = 1, #items, 2 do ids[#ids + 1] = items[i] end
    read = read + #ids
    local level_of = {}
    for level = 0, 3 do
      for i, score in ipairs(read_in_chunks('ZMSCORE', pending[level + 1], ids)) do
        if score then level_of[i] = level end
      end
    end
    for i in ipairs(ids) do
      if level_of[i] then live[#live + 1], at[#live + 1] = ids[i], i end
    end
    local cost_of, set_of, prio_of = read_costs(live)
    local gone, seen = {}, {}
    for j, id in ipairs(live) do
      local i, cost, listed = at[j], cost_of[j], set_of[j]
      local b = bucket_of(rules.bounds, cost)
      seen[i] = true
      if listed ~= b then  -- listed elsewhere too (or unrecorded): one set, the right one
        if listed and listed > 0 and listed ~= rules.only then
          redis.call('ZREM', bucket_sets[listed], id)
        end
        redis.call('HSET', costs, id, cost_record(cost, b, prio_of[j]))
      end
      if b ~= rules.only then
        gone[#gone + 1] = id
        redis.call('ZADD', bucket_sets[b], items[2 * i], id)
      else
        local view = views[level_of[i] + 1]
        view[#view + 1] = id
        view[#view + 1] = items[2 * i]
        view_costs[id] = cost
        counts[level_of[i] + 1] = counts[level_of[i] + 1] + 1
        kept = kept + 1
      end
    end
    for i, id in ipairs(ids) do
      if not seen[i] then gone[#gone + 1] = id end
    end
    if #gone > 0 then call_in_chunks('ZREM', set, gone) end
    if #ids < n then break end  -- the set's end
  end
  return counts, false
end

-- After a cost_buckets change (configure.lua set costs' RELIST field): the next
-- RELIST_STEP costs entries (HSCAN from the cursor RELIST holds) whose set is not the one
-- the current boundaries name move there, so that each consumer dedicated to a bucket
-- finds all of its bucket's requests again. True while the scan is not through.
local RELIST_STEP = 1000
local function relist_step(rules)
  local cursor = redis.call('HGET', costs, RELIST)
  if not cursor then return false end
  local scan = redis.call('HSCAN', costs, cursor, 'COUNT', RELIST_STEP)
  local entries, moved = scan[2], {}
  for k = 1, #entries, 2 do
    local id = entries[k]
    local cost, listed, prio = read_cost_record(entries[k + 1])
    local want = cost and (#rules.bounds > 0 and bucket_of(rules.bounds, cost) or 0)
    if want and want ~= listed then
      local arrival = listed > 0 and redis.call('ZSCORE', bucket_sets[listed], id)
      for level = 1, #pending do
        if arrival then break end
        arrival = redis.call('ZSCORE', pending[level], id)
      end
      if listed > 0 then redis.call('ZREM', bucket_sets[listed], id) end
      if not arrival then
        redis.call('HDEL', costs, id)  -- waits nowhere: a stale entry
      else
        if want > 0 then
          redis.call('ZADD', bucket_sets[want], arrival, id)
          moved[want] = true
        end
        redis.call('HSET', costs, id, cost_record(cost, want, prio))
      end
    end
  end
  local done = scan[1] == '0'
  if done then redis.call('HDEL', costs, RELIST) else redis.call('HSET', costs, RELIST, scan[1]) end
  for b in pairs(moved) do wake_bucket(bucket_markers, b) end
  return not done
end

-- Ids in the sets beyond the bucket count (written by hand, or left there once
-- relist_step was through): no request belongs there, and while any is listed
-- pick_from_sets reads the window instead. Each pop takes the next SWEEP_STEP of them out;
-- one still waiting moves to the set its cost names (its costs entry says so).
local SWEEP_STEP = 256
local function sweep_extra_sets(rules)
  local nb = bucket_count(rules.bounds)
  if nb == 0 or nb >= #bucket_sets then return end
  local extra = {}
  for b = nb + 1, #bucket_sets do extra[#extra + 1] = bucket_sets[b] end
  if redis.call('EXISTS', unpack(extra)) == 0 then return end  -- the usual case: one call
  local budget = SWEEP_STEP
  for b = nb + 1, #bucket_sets do
    if budget == 0 then return end
    local items = redis.call('ZRANGE', bucket_sets[b], 0, budget - 1, 'WITHSCORES')
    local ids, waits, live, at = {}, {}, {}, {}
    for i = 1, #items, 2 do ids[#ids + 1] = items[i] end
    if #ids > 0 then
      budget = budget - #ids
      call_in_chunks('ZREM', bucket_sets[b], ids)
      for level = 1, #pending do
        for i, score in ipairs(read_in_chunks('ZMSCORE', pending[level], ids)) do
          if score then waits[i] = true end
        end
      end
      for i, id in ipairs(ids) do
        if waits[i] then live[#live + 1], at[#live + 1] = id, i end
      end
      local cost_of, set_of, prio_of = read_costs(live)
      for j, id in ipairs(live) do
        local want, listed = bucket_of(rules.bounds, cost_of[j]), set_of[j]
        if listed ~= want then  -- listed here, elsewhere or nowhere: its bucket's set now
          if listed and listed > 0 and listed ~= b then
            redis.call('ZREM', bucket_sets[listed], id)
          end
          redis.call('ZADD', bucket_sets[want], items[2 * at[j]], id)
          redis.call('HSET', costs, id, cost_record(cost_of[j], want, prio_of[j]))
          wake_bucket(bucket_markers, want)
        end
      end
    end
  end
end

-- A level's first n (or more: callers stop at n) {id, score, ...}: from the zset, or the
-- dedicated consumer's view.
local function head(level, n)
  if views then return views[level + 1] end
  return redis.call('ZRANGE', pending[level + 1], 0, n - 1, 'WITHSCORES')
end

local function oldest(level)
  return tonumber(head(level, 1)[2])
end

-- The first n of each of the given levels, {id, score, ...} per level + 1, enough to merge
-- the n oldest of them. The fullest level's first n are read first; then of each other
-- level only those no younger than the last of them (the n oldest overall are among
-- these), so that Redis formats fewer scores: on Redis 7.0 printing each as text costs
-- more than any other part of a pop.
local function heads(count, levels, n)
  local got = {}
  if views then
    for _, level in ipairs(levels) do got[level + 1] = views[level + 1] end
    return got
  end
  if fair then return fair_heads(fair, count, levels, n) end
  local fullest
  for _, level in ipairs(levels) do
    if count[level + 1] > 0 and (not fullest or count[level + 1] > count[fullest + 1]) then
      fullest = level
    end
  end
  if not fullest then return got end
  local first = redis.call('ZRANGE', pending[fullest + 1], 0, n - 1, 'WITHSCORES')
  got[fullest + 1] = first
  local bound = #first == 2 * n and first[2 * n] or '+inf'
  for _, level in ipairs(levels) do
    if level ~= fullest and count[level + 1] > 0 then
      got[level + 1] = redis.call('ZRANGEBYSCORE', pending[level + 1], '-inf', bound,
                                  'WITHSCORES', 'LIMIT', 0, n)
    end
  end
  return got
end

-- The n oldest requests of the given levels, merged by arrival: each level's zset is
-- already in arrival order, so a merge of their heads (no sort, empty levels not read).
local function take(count, levels, n)
  -- per level: its items {id, score, ...}, the next one's index and score (nil at the end)
  local lists = {}
  local read = heads(count, levels, n)
  for _, level in ipairs(levels) do
    local items = read[level + 1]
    if items and items[1] then
      lists[#lists + 1] = {level = level, at = 1, items = items, score = tonumber(items[2])}
    end
  end
  local chosen = {}
  while #chosen < n do
    local best
    for _, l in ipairs(lists) do
      if l.score and (not best or l.score < best.score) then best = l end
    end
    if not best then break end
    chosen[#chosen + 1] = {id = best.items[best.at], score = best.score, level = best.level}
    best.at = best.at + 2
    best.score = tonumber(best.items[best.at + 1])
  end
  return chosen
end

-- The batch a bucket's requests make within max_batch_size and the budget (`group`: their
-- indexes in arrival order, `cost_of`: index -> cost), and whether it is full:
-- max_batch_size reached, or the next request would overrun the budget. The first
-- request always fits: one above the budget runs alone.
local function fit(rules, group, cost_of)
  local chosen, sum, top = {}, 0, 0
  for _, i in ipairs(group) do
    if #chosen == rules.batch_size then return chosen, true end
    local cost = cost_of[i]
    local s, t = sum + cost, math.max(top, cost)
    if rules.budget > 0 and #chosen > 0 and
       (rules.padded and (#chosen + 1) * t or s) > rules.budget then
      return chosen, true
    end
    chosen[#chosen + 1] = i
    sum, top = s, t
  end
  return chosen, #chosen == rules.batch_size
end

-- pick_costed's candidates: the oldest `window` requests of `levels`, as ids (in arrival
-- order) and a function giving {id, score, level} of a list of their indexes. Where one
-- of the levels has requests (the usual case) its ids are read without their scores
-- (formatting 5 x max_batch_size scores costs more than the rest of the pick): only the
-- candidates that are used get theirs.
local function candidates(rules, count, levels)
  local single
  if not views and not fair then
    for _, level in ipairs(levels) do
      if count[level + 1] > 0 then single = (single == nil) and level or false end
    end
  end
  local ids = {}
  if single then
    ids = redis.call('ZRANGE', pending[single + 1], 0, rules.window - 1)
    return ids, function(indexes)
      local out, names = {}, {}
      for k, i in ipairs(indexes) do names[k] = ids[i] end
      if #names == 0 then return out end
      local scores = redis.call('ZMSCORE', pending[single + 1], unpack(names))
      for k, name in ipairs(names) do
        out[k] = {id = name, score = tonumber(scores[k]), level = single}
      end
      return out
    end
  end
  local cands = take(count, levels, rules.window)
  for i, c in ipairs(cands) do ids[i] = c.id end
  return ids, function(indexes)
    local out = {}
    for k, i in ipairs(indexes) do out[k] = cands[i] end
    return out
  end
end

-- pick_costed's batch read from the bucket sets instead of the window: a bucket's group is
-- the head of its set, less ids waiting in other levels than `levels`, up to the window's
-- last arrival; so only the groups looked at are read, and the costs of their requests
-- only (none without a budget), whichever levels wait. Returns false where that does not
-- hold, and the window is read: tenants are served fairly, the sets are being relisted,
-- their sizes do not add up to the queue's (an older version's ids), a listed id waits
-- nowhere it should, the sets hold more than `window` ids between the oldest of `levels`
-- and the window's edge (mostly other levels'), or arrivals tie (within a group, at the
-- window's edge, or two buckets' oldest).
local function pick_from_sets(rules, count, levels, now, due_only)
  if views or fair or #rules.bounds == 0 or rules.relisting then return false end
  local mine, n = {}, 0  -- the levels picked from that have requests, and their total
  for _, l in ipairs(levels) do
    if count[l + 1] > 0 then mine[#mine + 1], n = l, n + count[l + 1] end
  end
  if n == 0 then return false end
  local nb, listed = bucket_count(rules.bounds), 0
  for b = 1, #bucket_sets do
    local size = redis.call('ZCARD', bucket_sets[b])
    if size > 0 and b > nb then return false end
    listed = listed + size
  end
  if listed ~= count[1] + count[2] + count[3] + count[4] then return false end
  local exact = listed == n  -- every listed id waits in `mine`
  local window = rules.window
  -- The window's edge (one level and more than the window): its last arrival and the
  -- next one's, as Redis gives them.
  local edge
  if #mine == 1 and n > window then
    edge = redis.call('ZRANGE', pending[mine[1] + 1], window - 1, window, 'WITHSCORES')
  end
  -- Whether arrival `score` (a string, as Redis gave it) is among the window's: true,
  -- false, or nil where the window's edge is a tie (its order is the window's to say).
  local function in_window(score)
    if n <= window then return true end
    if edge then
      local s, last = tonumber(score), tonumber(edge[2])
      if s < last then return true end
      if s > last then return false end
      return last ~= tonumber(edge[4]) or nil
    end
    local le, lt = 0, 0
    for _, l in ipairs(mine) do le = le + redis.call('ZCOUNT', pending[l + 1], '-inf', score) end
    if le <= window then return true end
    for _, l in ipairs(mine) do
      lt = lt + redis.call('ZCOUNT', pending[l + 1], '-inf', '(' .. score)
    end
    if lt >= window then return false end
    return nil
  end
  -- Where other levels wait too, a walk reads the sets from the oldest arrival in `mine`
  -- to the window's edge: those waiting longer elsewhere (the usual case: LOW behind a
  -- HIGH flood) are never read; and only where those sets' ids in that span are no more
  -- than the window (else they are mostly of other levels: the window is read instead).
  local from, to = '-inf', '+inf'
  if not exact then
    local first
    for _, l in ipairs(mine) do
      local head = redis.call('ZRANGE', pending[l + 1], 0, 0, 'WITHSCORES')
      if not first or tonumber(head[2]) < first then first, from = tonumber(head[2]), head[2] end
    end
    if edge then to = edge[2] end
    local span = 0
    for b = 1, nb do span = span + redis.call('ZCOUNT', bucket_sets[b], from, to) end
    if span > window then return false end
  end
  -- Up to `want` requests of bucket b's set that wait in `mine`, in the set's order:
  -- {ids, raw (their scores as Redis gave them), score, level}, each by index, the scores
  -- and levels from the levels' zsets; nil where the set and the levels disagree or
  -- arrivals tie.
  local function walk(b, want)
    local g = {ids = {}, raw = {}, score = {}, level = {}}
    local at, prev, k = 0, nil, 0
    while k < want do
      local n_read = exact and want - k or math.max(want - k, at)
      local ids = redis.call('ZRANGEBYSCORE', bucket_sets[b], from, to, 'LIMIT', at, n_read)
      if #ids == 0 then break end
      at = at + #ids
      local raw, level = redis.call('ZMSCORE', pending[mine[1] + 1], unpack(ids)), mine[1]
      if #mine > 1 then  -- the level of each: the first of `mine` that has it
        local left, left_at = ids, nil  -- left_at: nil, all of ids
        raw, level = {}, {}
        for _, l in ipairs(mine) do
          if #left == 0 then break end
          local scores, rest, rest_at = redis.call('ZMSCORE', pending[l + 1], unpack(left)), {}, {}
          for i = 1, #left do
            local j = left_at and left_at[i] or i
            if scores[i] then
              raw[j], level[j] = scores[i], l
            else
              rest[#rest + 1], rest_at[#rest + 1] = left[i], j
            end
          end
          left, left_at = rest, rest_at
        end
      end
      for j = 1, #ids do
        local r = raw[j]
        if r then
          local score = tonumber(r)
          if prev and score <= prev then return nil end  -- a tie, or out of order
          prev = score
          if k < want then
            k = k + 1
            g.ids[k], g.raw[k], g.score[k] = ids[j], r, score
            g.level[k] = type(level) == 'table' and level[j] or level
          end
        elseif exact then
          return nil
        elseif k > 0 and not g.gap_at then
          g.gap_at = k  -- the ids after the k-th are not next to it in the set
        end
      end
      if #ids < n_read then break end  -- the set's end
    end
    return g
  end
  local firsts = {}  -- per bucket: its oldest, in arrival order (in the window or not)
  for b = 1, nb do
    local head
    if exact then  -- its set's first: the group's walk checks it against the levels
      local item = redis.call('ZRANGE', bucket_sets[b], 0, 0, 'WITHSCORES')
      head = {raw = {item[2]}, score = {tonumber(item[2])}}
    else
      head = walk(b, 1)
      if not head then return false end
    end
    if head.raw[1] then
      firsts[#firsts + 1] = {bucket = b, score = head.score[1], raw = head.raw[1]}
    end
  end
  table.sort(firsts, function(x, y) return x.score < y.score end)
  for k = 2, #firsts do  -- a tie: the zset's order (by id) decides, left to the window
    if firsts[k].score == firsts[k - 1].score then return false end
  end
  -- Whether a bucket's oldest is in the window (a group of it): asked only of those
  -- looked at; the oldest of all is, where every request waiting is in `mine`.
  local function seen(k)
    if k == 1 and exact then return true end
    return in_window(firsts[k].raw)
  end
  local function due(first)
    local g = walk(first.bucket, rules.batch_size)
    if not g or g.score[1] ~= first.score then return false end
    local m = #g.ids
    if n > window then  -- the group ends at the window's edge: ranks grow with arrival
      local last = in_window(g.raw[m])
      if last == nil then return false end
      if not last then
        local lo, hi = 1, m  -- g[lo] is in the window, g[hi] is not
        while hi - lo > 1 do
          local mid = math.floor((lo + hi) / 2)
          local w = in_window(g.raw[mid])
          if w == nil then return false end
          if w then lo = mid else hi = mid end
        end
        m = lo
      end
    end
    local taken, full  -- fit takes the group's first `taken`
    if rules.budget > 0 then
      local cost_of, indexes = read_costs({unpack(g.ids, 1, m)}), {}
      for i = 1, m do indexes[i], cost_of[i] = i, cost_of[i] or 1 end
      local chosen
      chosen, full = fit(rules, indexes, cost_of)
      taken = #chosen
    else
      taken = math.min(m, rules.batch_size)
      full = taken == rules.batch_size
    end
    if due_only and not full and now - first.score < rules.delay then return nil end
    local out = {}
    for i = 1, taken do out[i] = {id = g.ids[i], score = g.score[i], level = g.level[i]} end
    -- Where nothing was passed over between them, the batch is a run of its set: commit
    -- takes it out by one range removal, without reading its costs entries.
    if not g.gap_at or taken <= g.gap_at then out.run_of = first.bucket end
    return out
  end
  for k, first in ipairs(firsts) do
    if first.bucket == rules.prefer then
      local w = seen(k)
      if w == nil then return false end
      if w then
        local chosen = due(first)
        if chosen ~= nil then return chosen ~= false, chosen or nil end
      end
    end
  end
  for k, first in ipairs(firsts) do
    local w = seen(k)  -- the later ones are younger: out of the window too
    if w == nil then return false end
    if not w then break end
    local chosen = due(first)
    if chosen ~= nil then return chosen ~= false, chosen or nil end
  end
  return true, nil
end

-- The rule's batch with costs on: the oldest `window` requests of `levels`, grouped by
-- bucket, each group fitted to the budget. due_only (the dynamic rule): the first group,
-- in the order of their oldest requests, that is full or whose oldest has waited the
-- delay; nil if none is. Otherwise the group of the oldest request.
local function pick_costed(rules, count, levels, now, due_only)
  local handled, picked = pick_from_sets(rules, count, levels, now, due_only)
  if handled then return picked end
  local ids, entries = candidates(rules, count, levels)
  local cost_of = {}
  if view_costs then  -- a dedicated consumer read the costs with its view
    for i, id in ipairs(ids) do cost_of[i] = view_costs[id] end
  else
    cost_of = read_costs(ids)
  end
  local groups, order, bounds, bucket_by_cost = {}, {}, rules.bounds, {}
  for i = 1, #ids do
    local cost = cost_of[i]
    local b = bucket_by_cost[cost]
    if not b then
      b = bucket_of(bounds, cost)
      bucket_by_cost[cost] = b
    end
    local group = groups[b]
    if not group then
      group = {}
      groups[b] = group
      order[#order + 1] = b
    end
    group[#group + 1] = i
  end
  local function due(b)
    local chosen, full = fit(rules, groups[b], cost_of)
    if not due_only or full then return entries(chosen) end
    local first = entries({groups[b][1]})[1]
    if fair then first = fair_oldest(entries(groups[b])) end  -- not first in fair order
    if now - first.score >= rules.delay then return entries(chosen) end
    return nil
  end
  local preferred = groups[rules.prefer] and due(rules.prefer)
  if preferred then return preferred end
  for _, b in ipairs(order) do
    local chosen = due(b)
    if chosen then return chosen end
  end
  return nil
end

-- The rule's batch from `levels`: the oldest max_batch_size, or pick_costed's.
local function pick(rules, count, levels, now)
  if rules.costed then return pick_costed(rules, count, levels, now, false) end
  return take(count, levels, rules.batch_size)
end

-- The strategy's batch {id, score, level}..., or nil and the reply {0, wait_us} when
-- nothing is due yet. count: pending requests per level + 1; total: their sum.
local function choose(rules, count, total, now)
  local strategy, batch_size, delay, aging = rules.strategy, rules.batch_size, rules.delay,
                                             rules.aging
  if strategy == 'fifo' then return pick(rules, count, {0, 1, 2}, now) end
  if strategy == 'dynamic' then
    -- The oldest request's wait is read only where the rule needs it (a backlog does not).
    local function until_due()
      local first = math.huge
      for level = 0, 2 do
        if count[level + 1] > 0 then first = math.min(first, oldest(level)) end
      end
      return first + delay - now
    end
    if rules.costed then
      local chosen = pick_costed(rules, count, {0, 1, 2}, now, true)
      if chosen then return chosen end
      return nil, {0, math.max(0, until_due())}
    end
    if total < batch_size then
      local due_in = until_due()
      if due_in > 0 then return nil, {0, due_in} end
    end
    return take(count, {0, 1, 2}, batch_size)
  end
  if count[1] > 0 then return pick(rules, count, {0}, now) end
  if count[2] > 0 then
    local first = oldest(1)
    local chosen = rules.costed and pick_costed(rules, count, {1}, now, true)
    if chosen then return chosen end
    if rules.costed or (count[2] < batch_size and now - first < delay) then
      local due = first + delay
      if aging > 0 then
        -- Until the next promotion. A NORMAL request that waited aging_ms already was
        -- submitted LOW (promote_aged moved the others): it moves up at 2 x aging_ms.
        -- One that has not moves up at aging_ms.
        due = math.min(due, first + 2 * aging)
        local younger = redis.call('ZRANGEBYSCORE', pending_normal, '(' .. int(now - aging),
                                   '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
        if younger[1] then due = math.min(due, tonumber(younger[2]) + aging) end
        if count[3] > 0 then due = math.min(due, oldest(2) + aging) end
      end
      return nil, {0, math.max(0, due - now)}
    end
    return take(count, {1}, batch_size)
  end
  return pick(rules, count, {2}, now)
end

-- Whether a waiting request is past its deadline (then nothing may be batched before
-- expire_due.lua takes it out), and the earliest deadline (µs; nil if none).
local function past_deadline(now)
  local first = redis.call('ZRANGE', deadlines, 0, 0, 'WITHSCORES')
  local at = first[1] and tonumber(first[2])
  return at ~= nil and at <= now, at
end

-- Delayed requests (past their deadline under on_timeout = delay) when no level waits.
local function take_delayed(rules, count, now)
  return pick(rules, count, {3}, now)
end

-- Members whose id no producer makes (written by hand) leave the queue for the
-- dead-letter set instead of a batch. `chosen` itself where none does.
local function drop_malformed(chosen, now)
  local kept, dropped = {}, {}
  for _, c in ipairs(chosen) do
    if valid_id(c.id) then
      kept[#kept + 1] = c
    else
      dropped[#dropped + 1] = c.id
      redis.call('ZREM', pending[c.level + 1], c.id)
      add_dead_letter(dead, dead_reason, c.id, now, cjson.encode({v = 1, id = c.id,
        ok = false, error = {type = 'MalformedRequest', message = 'request id written ' ..
        'by hand: not 1-128 characters from letters, digits, _ . -'}}))
    end
  end
  if #dropped == 0 then return chosen end
  unlist_waiting(costs, bucket_sets, dropped)
  return kept
end

-- A request delivered before whose batch never completed (its consumer crashed, hung or
-- lost its lease) runs in a batch of its own, so a payload that kills its consumer cannot
-- drag its batch-mates to max_attempts with it. Truncates `chosen` there; returns what
-- commit needs of what is left: the ids, their raw jobs values and, per request (nil where
-- the meta is unreadable), its deadline and attempts.
local function isolate_retried(chosen)
  -- One variadic call per key rather than one per request: the script's cost is mostly
  -- the number of redis.call()s.
  local ids, deadlines_of, attempts_of = {}, {}, {}
  for i, c in ipairs(chosen) do ids[i] = c.id end
  local raw = redis.call('HMGET', jobs, unpack(ids))
  for i in ipairs(chosen) do
    local deadline, attempts = pop_fields(raw[i])
    local retried = attempts and attempts > 0
    if retried and i > 1 then
      for j = #chosen, i, -1 do chosen[j] = nil end
      break
    end
    deadlines_of[i], attempts_of[i] = deadline, attempts
    if retried then
      for j = #chosen, 2, -1 do chosen[j] = nil end
      break
    end
  end
  return {ids = ids, raw = raw, deadline = deadlines_of, attempts = attempts_of}
end

-- The jobs value delivered for a member without (valid) meta, written by hand: its whole
-- value as the envelope under a meta that has used every attempt, so that the consumer
-- dead-letters it instead of crashing.
local function hand_written(rules, c, raw, now)
  local arrival = c.score
  if arrival ~= arrival or arrival == math.huge or arrival == -math.huge then arrival = now end
  return format_job({prio = math.min(c.level, 2), arrival = arrival, deadline = 0,
                     attempts = rules.max_attempts, keep = false, producer = '',
                     envelope = raw or ''})
end

-- Move `chosen` in flight under a new batch id and build the reply.
local function commit(rules, consumer, lease_ms, chosen, read, total, now)
  local batch_id = redis.call('INCR', seq)
  local lease_deadline = now + lease_ms * 1000
  local reply = {batch_id, int(now), int(lease_deadline), total - #chosen}
  local ids = {unpack(read.ids, 1, #chosen)}  -- what is left after isolate_retried
  local waits, by_level, owner_fields = {}, {{}, {}, {}, {}}, {}
  for i, c in ipairs(chosen) do
    local id = c.id
    table.insert(by_level[c.level + 1], id)
    local value, attempts, deadline = read.raw[i], read.attempts[i], read.deadline[i]
    if not attempts then
      value, attempts, deadline = hand_written(rules, c, value, now), rules.max_attempts, 0
    end
    local state = 'run'
    if attempts >= rules.max_attempts then
      state = 'exhausted'
    elseif deadline > 0 and deadline <= now then
      state = 'expired'
    else
      waits[#waits + 1] = int(now - c.score)  -- the score is the request's arrival
    end
    owner_fields[#owner_fields + 1] = id
    owner_fields[#owner_fields + 1] = batch_id
    -- The delivery's number, attempts + 1, is not written back: requeue_expired counts a
    -- delivery that ended without a result, complete a dead one (a write saved here).
    local r = #reply
    reply[r + 1], reply[r + 2], reply[r + 3], reply[r + 4], reply[r + 5] =
      id, value, attempts + 1, state, c.level
  end
  for level = 0, 3 do
    local members = by_level[level + 1]
    if #members > 0 then redis.call('ZREM', pending[level + 1], unpack(members)) end
  end
  redis.call('ZREM', deadlines, unpack(ids))  -- deadlines holds waiting requests only
  call_in_chunks('HSET', owner, owner_fields)  -- 2 x max_batch_size values
  fair_commit(fair, chosen)  -- counters, then out of the fair index (lua/_fair.lua)
  -- The batch leaves costs and the bucket sets its entries name (those it was put in).
  local by_bucket
  local run = chosen.run_of  -- a run of one set (pick_from_sets; nothing dropped since)
  if run then
    -- One range removal, by arrival (the commands of the documented ACL rule), where
    -- the range holds the batch alone; arrivals are unique, unless written by hand.
    by_bucket = {[run] = ids}
    local lo, hi = int(chosen[1].score), int(chosen[#chosen].score)
    if redis.call('ZCOUNT', bucket_sets[run], lo, hi) == #ids then
      redis.call('ZREMRANGEBYSCORE', bucket_sets[run], lo, hi)
    else
      call_in_chunks('ZREM', bucket_sets[run], ids)
    end
    call_in_chunks('HDEL', costs, ids)
  else
    by_bucket = unlist_waiting(costs, bucket_sets, ids)
  end
  -- Tenants (lua/_tenants.lua): the batch's requests leave waiting for in flight.
  local tally = tenant_tally()
  for i = 1, #chosen do
    local t = job_tenant(read.raw[i])
    if t then
      tally.add_tenant(t, 'w', -1)
      tally.add_tenant(t, 'f', 1)
    end
  end
  tally.flush(tenants)
  redis.call('ZADD', inflight, int(lease_deadline), batch_id)
  redis.call('HSET', batches, batch_id, consumer .. '|' .. table.concat(ids, ','))
  redis.call('HINCRBY', stats, 'batches', 1)
  redis.call('HINCRBY', stats, 'batched_requests', #ids)
  if #waits > 0 then push_samples(wait_samples, unpack(waits)) end
  -- More work remains: wake one more idle consumer so it can take it or time its due date
  -- (and one dedicated to this batch's bucket: more of it may wait; other buckets'
  -- arrivals woke theirs).
  if total > #chosen then
    wake_consumers(marker)
    for b in pairs(by_bucket) do
      if b <= bucket_count(rules.bounds) then wake_bucket(bucket_markers, b) end
    end
  end
  return reply
end

local consumer, lease_ms = ARGV[1], int_arg(ARGV[2], 100, 86400000)
local bucket = int_arg(ARGV[3] or '0', -(MAX_COST_BUCKETS + 1), MAX_COST_BUCKETS + 1)
if type(consumer) ~= 'string' or consumer == '' or string.find(consumer, '|') then
  return {-3, 'consumer'}
end
if not lease_ms then return {-3, 'lease_ms'} end
if not bucket then return {-3, 'bucket'} end
local delay_ms = ARGV[4] and policy_int('max_queue_delay_ms', ARGV[4])
if ARGV[4] and not delay_ms then return {-3, 'delay_ms'} end

local rules, err = read_policy()
if not rules then return err end
rules.prefer, rules.only = math.max(bucket, 0), math.max(-bucket, 0)
if rules.only == 1 and #rules.bounds == 0 then rules.only = 0 end  -- bucket 1 is all
if delay_ms then rules.delay = delay_ms * 1000 end
local now = queue_now(clock, stats)
redis.call('ZADD', consumers, int(now), consumer)
fair = fair_index(rules.fairness, fair_sets, fair_counters, fair_who)
if fair then
  fair.pending, fair.tenants, fair.costs = pending, tenants, costs
  fair.quotas = redis.call('HGET', policy, 'tenant_quotas')
end
local retried, next_retry, retried_jobs = promote_retries(
  retry, pending, jobs, costs, deadlines, bucket_sets, rules.bounds, now, rules.batch_size,
  fair)
if retried > 0 then  -- another consumer (or bucket) may be the one to run them
  wake_consumers(marker)
  wake_buckets(bucket_markers, bucket_count(rules.bounds))
  local tally = tenant_tally()  -- tenants (lua/_tenants.lua): waiting again
  for _, raw in ipairs(retried_jobs) do
    local t = job_tenant(raw)
    if t then tally.add_tenant(t, 'w', 1) end
  end
  tally.flush(tenants)
end
local expired, first_deadline = past_deadline(now)
if expired then return {-4} end
rules.relisting = relist_step(rules)
if not rules.relisting then sweep_extra_sets(rules) end
if rules.strategy == 'priority' and rules.aging > 0 then promote_aged(rules, now) end

local count = {redis.call('ZCARD', pending_high), redis.call('ZCARD', pending_normal),
               redis.call('ZCARD', pending_low), redis.call('ZCARD', delayed)}
local waiting = count[1] + count[2] + count[3]
local total = waiting + count[4]
if total == 0 then return {0, next_retry and next_retry - now or -1} end
local chosen, wait, cut
if rules.only > 0 then
  -- Dedicated: the rules see its bucket's requests only; the queue's totals still say
  -- whether delayed requests may run and what remains.
  local mine
  mine, cut = read_views(rules)
  if (waiting > 0 and mine[1] + mine[2] + mine[3] == 0) or (waiting == 0 and mine[4] == 0) then
    wait = {0, -1}  -- nothing of its bucket in view: until a wake-up (or the next deadline)
  elseif waiting == 0 then
    chosen = take_delayed(rules, mine, now)
  else
    chosen, wait = choose(rules, mine, mine[1] + mine[2] + mine[3], now)
  end
elseif waiting == 0 then
  chosen = take_delayed(rules, count, now)
else
  chosen, wait = choose(rules, count, waiting, now)
end
if fair and fair.blocked and not wait and (not chosen or #chosen == 0) then
  chosen, wait = nil, {0, -1}  -- every tenant that waits is at its max_in_flight
end
if not chosen then
  -- A view cut short by dead ids, or the sets not yet relisted after a cost_buckets
  -- change: pop again at once (each pop does a bounded step more) rather than sleep.
  if cut or (rules.relisting and rules.only > 0) then return {0, 0} end
  if first_deadline and (wait[2] < 0 or first_deadline - now < wait[2]) then
    wait[2] = first_deadline - now
  end
  if next_retry and (wait[2] < 0 or next_retry - now < wait[2]) then
    wait[2] = next_retry - now
  end
  return wait
end
chosen = drop_malformed(chosen, now)
if #chosen == 0 then return {0, 0} end
return commit(rules, consumer, lease_ms, chosen, isolate_retried(chosen), total, now)
