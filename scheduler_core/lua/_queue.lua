-- Helpers that write the queue's state, inlined where a script says
-- "-- @include _queue.lua" (after _common.lua). Each takes the keys it touches as
-- arguments: the script names them (KEYS[i]) at the top of its body.

-- Wake an idle consumer: consumers block on the marker (BZPOPMIN) while nothing is due.
local function wake_consumers(marker)
  redis.call('ZADD', marker, 0, 'w')
end

-- Wake an idle consumer dedicated to cost bucket b (--only-bucket): each bucket has a
-- marker of its own (KEYS[24..28]), so that a consumer dedicated to one bucket never
-- takes the wake-up meant for another, nor for the consumers that serve every bucket.
local function wake_bucket(bucket_markers, b)
  redis.call('ZADD', bucket_markers[b], 0, 'w')
end

-- Every bucket's (n: the queue's bucket count, 0 without cost buckets).
local function wake_buckets(bucket_markers, n)
  for b = 1, n do wake_bucket(bucket_markers, b) end
end

-- costs[id] while request `id` waits (pending or delayed): "<cost>:<bucket>:<priority>",
-- its cost, the cost bucket set it is listed in (0: none) and the priority it was
-- submitted at, so that a pop learns costs (and aging the priority) without reading the
-- jobs value (its payload), and every exit takes the id out of the set it was put in,
-- whatever cost_buckets says by then (wire.cost_record). prio nil: "<cost>:<bucket>",
-- as an older version wrote it.
local function cost_record(cost, bucket, prio)
  -- The usual one, cost 1 and no bucket, without a format.
  local head = (cost == 1 and bucket == 0) and '1:0' or int(cost) .. ':' .. bucket
  if prio then return head .. ':' .. prio end
  return head
end

-- The cost, bucket set and priority (nil if not recorded: an older version's) of a costs
-- value; nil where there is none (a request listed before the costs hash existed, or
-- written by hand). A queue has few distinct costs: each value is matched once per call.
local RECORDS = {}
local function read_cost_record(raw)
  if not raw then return nil end
  local r = RECORDS[raw]
  if r == nil then
    local c, b, p = string.match(raw, '^(%d+):([0-5]):([0-2])$')
    if not c then c, b = string.match(raw, '^(%d+):([0-5])$') end
    r = (c and #c <= 10) and {tonumber(c), tonumber(b), tonumber(p)} or false
    RECORDS[raw] = r
  end
  if r then return r[1], r[2], r[3] end
  return nil
end

-- The costs field (not an id: '~' is no id's) that marks the bucket sets as listed under
-- older cost_buckets: configure.lua sets it to '0' when the boundaries change; each pop
-- then moves the next entries (an HSCAN cursor, its value) to the set the boundaries
-- name, and removes it once the scan is through (pop_batch's relist_step).
local RELIST = '~relist'

-- A request starts waiting (enqueue, re-queue, dead-letter retry): its costs entry and,
-- with cost buckets (`bounds` not empty), its bucket's set, score = arrival, so that a
-- consumer dedicated to the bucket finds it however many requests of other buckets wait
-- ahead of it (pop_batch's read_views).
local function list_waiting(costs, bucket_sets, bounds, id, cost, arrival, prio)
  local b = 0
  if #bounds > 0 then
    b = bucket_of(bounds, cost)
    redis.call('ZADD', bucket_sets[b], int(arrival), id)
  end
  redis.call('HSET', costs, id, cost_record(cost, b, prio))
end

-- Requests `ids` stop waiting (popped, cancelled, expired, dropped): out of the bucket set
-- their costs entry names and out of costs. An id without an entry was listed, if at
-- all, under boundaries that may have changed since: it leaves every set. Returns the
-- sets it took ids out of, bucket -> {id, ...}.
local function unlist_waiting(costs, bucket_sets, ids)
  if #ids == 0 then return {} end
  local raw = read_in_chunks('HMGET', costs, ids)
  local by_set = {}
  for i, id in ipairs(ids) do
    local _, b = read_cost_record(raw[i])
    for s = b or 1, b or #bucket_sets do
      if s > 0 then
        by_set[s] = by_set[s] or {}
        table.insert(by_set[s], id)
      end
    end
  end
  for s, members in pairs(by_set) do call_in_chunks('ZREM', bucket_sets[s], members) end
  call_in_chunks('HDEL', costs, ids)
  return by_set
end

-- Arrival scores: Redis time, strictly increasing per queue, so that ties keep arrival
-- order. next() issues one; save() stores the last one issued (once per call), with the
-- queue's clock (the clock key holds both): `now` is queue_now's, called first.
local function arrival_clock(now)
  local c = clock_now
  local last = c.read
  local arrivals = {}
  function arrivals.next()
    last = math.max(now, last + 1)
    return last
  end
  function arrivals.save()
    if last > c.latest then c.latest, c.dirty = last, true end
    note_clock()
  end
  return arrivals
end

-- List a request as dead-lettered, with the error envelope that says why; its
-- jobs value (meta and envelope) stays in jobs until it is retried or purged.
local function add_dead_letter(dead, dead_reason, id, now, reason)
  redis.call('ZADD', dead, int(now), id)
  redis.call('HSET', dead_reason, id, reason)
end

-- The request ids in a batches value ("consumer|id,id,..."), and how many; count_only:
-- the count alone. Plain-text finds: a pattern would test every character of the list
-- against a class.
local function split_members(raw, count_only)
  local ids, n = {}, 0
  local at = raw and string.find(raw, '|', 1, true)
  while at do
    local comma = string.find(raw, ',', at + 1, true)
    local last = (comma or #raw + 1) - 1
    if last > at then
      n = n + 1
      if not count_only then ids[n] = string.sub(raw, at + 1, last) end
    end
    at = comma
  end
  return ids, n
end

-- The request ids of a batch in flight.
local function batch_members(batches, batch_id)
  return (split_members(redis.call('HGET', batches, batch_id)))
end

-- A batch leaves the in-flight set: all of it answered, or its lease expired.
local function release_batch(inflight, batches, batch_id)
  redis.call('ZREM', inflight, batch_id)
  redis.call('HDEL', batches, batch_id)
end

-- The result key of request `id`, {bg:q}:result:<id>, made from the queue's policy key
-- {bg:q}:policy: for an id the script only learns inside Redis (an idempotency key's
-- value), which its caller could not pass in KEYS. It carries the queue's hash tag, so
-- it lives in the cluster slot of the declared keys.
local function result_key_of(policy, id)
  return string.sub(policy, 1, -7) .. 'result:' .. id
end

-- Whether Redis still knows request `id`: waiting, in flight or dead-lettered (its
-- envelope is in jobs), or finished with its result not yet expired.
local function request_known(jobs, result, id)
  return redis.call('HEXISTS', jobs, id) == 1 or redis.call('EXISTS', result) == 1
end

-- A request's result, fetchable by id (Producer.fetch) for ttl seconds.
local function store_result(result, envelope, ttl)
  redis.call('SET', result, envelope, 'EX', ttl)
end

-- Result envelopes pushed to their producer's inbox, in order; the inbox expires with them.
local function deliver_results(inbox, ttl, ...)
  redis.call('RPUSH', inbox, ...)
  redis.call('EXPIRE', inbox, ttl)
end

-- A request that ran, or was about to, waits again (a lapsed lease, a retry that fell
-- due, a preempted sequence): back in its level under its arrival score (its place kept),
-- in its bucket's set, in the fair index (`fair`: nil under fairness none), and its
-- deadline listed again. `m` is its parsed jobs value (nil if unreadable: LOW, arriving
-- now, cost 1).
local function return_to_waiting(pending, costs, deadlines, bucket_sets, bounds, id, m, now,
                                 fair)
  local prio, arrival = 2, now
  if m then prio, arrival = m.prio, m.arrival end
  redis.call('ZADD', pending[prio + 1], int(arrival), id)
  list_waiting(costs, bucket_sets, bounds, id, m and m.cost or 1, arrival, prio)
  if m and m.deadline > 0 then redis.call('ZADD', deadlines, m.deadline_s, id) end
  if fair then
    fair_list(fair, {{prio, m and envelope_tenant(m.envelope) or nil, arrival, id}})
  end
end

-- Requests whose retry is due (complete.lua's 'retry': listed in the retry set until
-- their backoff, or their deadline, passes) go back to their level under their arrival
-- score, with their deadline listed again, at most `limit` per call. Returns how many
-- moved, when the next one falls due (µs; nil if none waits) and the jobs values of
-- those moved (for their tenants' counters). `fair`: the fair index (nil: none).
local function promote_retries(retry, pending, jobs, costs, deadlines, bucket_sets, bounds,
                               now, limit, fair)
  -- One call in the usual case (none waits, or none is due): every pop runs this.
  local first = redis.call('ZRANGE', retry, 0, 0, 'WITHSCORES')
  if not first[2] or tonumber(first[2]) > now then
    return 0, first[2] and tonumber(first[2]), {}
  end
  local due = redis.call('ZRANGEBYSCORE', retry, '-inf', int(now), 'LIMIT', 0, limit)
  local moved = {}
  for _, id in ipairs(due) do
    local raw = redis.call('HGET', jobs, id)
    moved[#moved + 1] = raw
    return_to_waiting(pending, costs, deadlines, bucket_sets, bounds, id, parse_job(raw), now,
                      fair)
  end
  if #due > 0 then redis.call('ZREM', retry, unpack(due)) end
  local next_due = redis.call('ZRANGE', retry, 0, 0, 'WITHSCORES')
  return #due, next_due[2] and tonumber(next_due[2]), moved
end
