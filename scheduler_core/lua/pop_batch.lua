--[[ pop_batch: apply the queue's strategy and, if a batch is due, move it in flight.

This is where the scheduling rules live (SEED-EN.md sections 1-2):
  fifo      oldest requests across all priorities, up to max_batch_size, never waits.
  dynamic   oldest across all priorities; released when max_batch_size wait, or when the
            oldest has waited max_queue_delay_ms; never earlier.
  priority  HIGH waiting -> up to max_batch_size HIGH at once, no waiting;
            else NORMAL waiting -> the dynamic rule on NORMAL (nothing while not due);
            else LOW -> up to max_batch_size LOW.
            Aging: a request that has waited aging_ms moves up one level, 2 x aging_ms two
            levels, so NORMAL and LOW are served even under sustained HIGH load.

KEYS[1]  {bg:q}:policy      hash
KEYS[2]  {bg:q}:pending:0   zset  HIGH    (score = arrival, µs)
KEYS[3]  {bg:q}:pending:1   zset  NORMAL
KEYS[4]  {bg:q}:pending:2   zset  LOW
KEYS[5]  {bg:q}:jobs        hash  id -> envelope
KEYS[6]  {bg:q}:meta        hash  id -> meta (attempts incremented here)
KEYS[7]  {bg:q}:owner       hash  id -> batch id
KEYS[8]  {bg:q}:inflight    zset  batch id -> lease deadline (µs)
KEYS[9]  {bg:q}:batches     hash  batch id -> "consumer|ids"
KEYS[10] {bg:q}:seq         string batch id counter
KEYS[11] {bg:q}:marker      zset  wake-up marker
KEYS[12] {bg:q}:consumers   zset  consumer -> last heartbeat (µs)
KEYS[13] {bg:q}:stats       hash  counters
KEYS[14] {bg:q}:samples:wait list recent queue waits (µs), capped
KEYS[15] {bg:q}:dead        zset  dead-lettered id -> time (µs)
KEYS[16] {bg:q}:dead:reason hash  dead-lettered id -> error envelope

ARGV[1]  consumer name (no '|')
ARGV[2]  lease in ms (100..86400000)

Returns  {batch_id, now_us, lease_deadline_us, remaining, then per request 7 values:
          id, envelope (false if missing), arrival_us, attempts (this delivery, 1-based),
          producer, state, level}
         remaining: requests still pending after this batch (all priorities); a
         consumer fetches its next batch while the model runs only when it is > 0
         state: 'run' | 'expired' (deadline passed: do not run) |
                'exhausted' (max_attempts deliveries used: dead-letter it)
         {0, wait_us}  nothing due; µs until the next request falls due, -1 if none
Errors   {-1}  queue has no policy (no consumer configured it yet)
         {-3, field} malformed argument, or {-3, 'policy'}: the stored policy is unreadable;
               nothing written

A request delivered before (its batch was re-queued after a crash or hang) is returned
in a batch of its own, so that a poison payload fails alone. A member whose id no producer
makes (written by hand) is dead-lettered here, never delivered; if that leaves nothing,
the reply is {0, 0} (pop again at once).
Work is bounded: at most 2 x max_batch_size promotions and max_batch_size pops per call.
]]
-- @include _common.lua

local consumer, lease_ms = ARGV[1], int_arg(ARGV[2], 100, 86400000)
if type(consumer) ~= 'string' or consumer == '' or string.find(consumer, '|') then
  return {-3, 'consumer'}
end
if not lease_ms then return {-3, 'lease_ms'} end

local policy = redis.call('HMGET', KEYS[1], 'strategy', 'max_batch_size',
                          'max_queue_delay_ms', 'aging_ms', 'max_attempts')
if not policy[1] then return {-1} end
local strategy = policy[1]
local batch_size = int_arg(policy[2], 1, 4096)
local delay = int_arg(policy[3], 0, 600000)
local aging = int_arg(policy[4], 0, 86400000)
local max_attempts = int_arg(policy[5], 1, 100)
if not (batch_size and delay and aging and max_attempts) or (strategy ~= 'fifo'
    and strategy ~= 'dynamic' and strategy ~= 'priority') then
  return {-3, 'policy'}  -- altered by hand: nothing written
end
delay, aging = delay * 1000, aging * 1000

local now = now_us()
redis.call('ZADD', KEYS[12], int(now), consumer)

local function move(from, to, id, score)
  redis.call('ZREM', KEYS[2 + from], id)
  redis.call('ZADD', KEYS[2 + to], score, id)
end

-- Aging (priority only): level = original priority - floor(wait / aging_ms).
if strategy == 'priority' and aging > 0 then
  local limit = 2 * batch_size
  local low = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', int(now - aging),
                         'WITHSCORES', 'LIMIT', 0, limit)
  for i = 1, #low, 2 do move(2, 1, low[i], low[i + 1]) end
  local twice = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', int(now - 2 * aging),
                           'WITHSCORES', 'LIMIT', 0, limit)
  for i = 1, #twice, 2 do move(1, 0, twice[i], twice[i + 1]) end
  local once = redis.call('ZRANGEBYSCORE', KEYS[3], '(' .. int(now - 2 * aging),
                          int(now - aging), 'WITHSCORES', 'LIMIT', 0, limit)
  for i = 1, #once, 2 do
    local m = parse_meta(redis.call('HGET', KEYS[6], once[i]))
    if not m or m.prio <= 1 then move(1, 0, once[i], once[i + 1]) end
  end
end

local count = {redis.call('ZCARD', KEYS[2]), redis.call('ZCARD', KEYS[3]),
               redis.call('ZCARD', KEYS[4])}
local total = count[1] + count[2] + count[3]
if total == 0 then return {0, -1} end

local function oldest(level)
  local first = redis.call('ZRANGE', KEYS[2 + level], 0, 0, 'WITHSCORES')
  if first[1] then return tonumber(first[2]) end
  return nil
end

-- The n oldest requests of the given levels, merged by arrival: each level's zset is
-- already in arrival order, so a merge of its first n (no sort, empty levels not read).
local function take(levels, n)
  local lists = {}  -- per level: its items {id, score, ...} and the next one's index
  for _, level in ipairs(levels) do
    if count[level + 1] > 0 then
      lists[#lists + 1] = {level = level, at = 1,
        items = redis.call('ZRANGE', KEYS[2 + level], 0, n - 1, 'WITHSCORES')}
    end
  end
  local chosen = {}
  while #chosen < n do
    local best, best_score
    for _, l in ipairs(lists) do
      local score = l.items[l.at] and tonumber(l.items[l.at + 1])
      if score and (not best or score < best_score) then best, best_score = l, score end
    end
    if not best then break end
    chosen[#chosen + 1] = {id = best.items[best.at], score = best_score, level = best.level}
    best.at = best.at + 2
  end
  return chosen
end

local function wait_until(due)
  return {0, math.max(0, due - now)}
end

local chosen
if strategy == 'fifo' then
  chosen = take({0, 1, 2}, batch_size)
elseif strategy == 'dynamic' then
  local first = math.huge
  for level = 0, 2 do first = math.min(first, oldest(level) or math.huge) end
  if total < batch_size and now - first < delay then return wait_until(first + delay) end
  chosen = take({0, 1, 2}, batch_size)
else
  if count[1] > 0 then
    chosen = take({0}, batch_size)
  elseif count[2] > 0 then
    local first = oldest(1)
    if count[2] < batch_size and now - first < delay then
      local due = first + delay
      if aging > 0 then
        due = math.min(due, first + aging)
        if count[3] > 0 then due = math.min(due, oldest(2) + aging) end
      end
      return wait_until(due)
    end
    chosen = take({1}, batch_size)
  else
    chosen = take({2}, batch_size)
  end
end

-- A request delivered before whose batch never completed (its consumer crashed, hung or
-- lost its lease) runs in a batch of its own, so a payload that kills its consumer cannot
-- drag its batch-mates to max_attempts with it.
local metas, kept = {}, {}
for _, c in ipairs(chosen) do
  if valid_id(c.id) then
    kept[#kept + 1] = c
  else
    redis.call('ZREM', KEYS[2 + c.level], c.id)
    redis.call('ZADD', KEYS[15], int(now), c.id)
    redis.call('HSET', KEYS[16], c.id, cjson.encode({v = 1, id = c.id, ok = false,
      error = {type = 'MalformedRequest', message = 'request id written by hand: not ' ..
               '1-128 characters from letters, digits, _ . -'}}))
  end
end
chosen = kept
if #chosen == 0 then return {0, 0} end
-- One variadic call per key rather than one per request: the script's cost is mostly
-- the number of redis.call()s.
local chosen_ids = {}
for i, c in ipairs(chosen) do chosen_ids[i] = c.id end
local raw_metas = redis.call('HMGET', KEYS[6], unpack(chosen_ids))
for i, c in ipairs(chosen) do
  local m = parse_meta(raw_metas[i])
  local retried = m and m.attempts > 0
  if retried and i > 1 then
    for j = #chosen, i, -1 do chosen[j] = nil end
    break
  end
  metas[i] = m
  if retried then
    for j = #chosen, 2, -1 do chosen[j] = nil end
    break
  end
end

local batch_id = redis.call('INCR', KEYS[10])
local lease_deadline = now + lease_ms * 1000
local reply = {batch_id, int(now), int(lease_deadline), total - #chosen}
local ids = {unpack(chosen_ids, 1, #chosen)}  -- what is left of chosen_ids
local waits, by_level, meta_fields, owner_fields = {}, {{}, {}, {}}, {}, {}
local envelopes = redis.call('HMGET', KEYS[5], unpack(ids))
for i, c in ipairs(chosen) do
  local id = c.id
  table.insert(by_level[c.level + 1], id)
  -- A member without (valid) meta was written by hand: deliver it once, marked so the
  -- consumer dead-letters it instead of crashing.
  local arrival = c.score
  if arrival ~= arrival or arrival == math.huge or arrival == -math.huge then arrival = now end
  local m = metas[i] or
    {prio = c.level, arrival = arrival, deadline = 0, attempts = max_attempts, producer = ''}
  local state = 'run'
  if m.attempts >= max_attempts then
    state = 'exhausted'
  elseif m.deadline > 0 and m.deadline <= now then
    state = 'expired'
  else
    waits[#waits + 1] = int(now - m.arrival)
  end
  m.attempts = m.attempts + 1
  meta_fields[#meta_fields + 1] = id
  meta_fields[#meta_fields + 1] = format_meta(m)
  owner_fields[#owner_fields + 1] = id
  owner_fields[#owner_fields + 1] = batch_id
  local r = #reply
  reply[r + 1], reply[r + 2], reply[r + 3], reply[r + 4] = id, envelopes[i],
                                                          m.arrival_s or int(m.arrival),
                                                          m.attempts
  reply[r + 5], reply[r + 6], reply[r + 7] = m.producer, state, c.level
end
for level = 0, 2 do
  local members = by_level[level + 1]
  if #members > 0 then redis.call('ZREM', KEYS[2 + level], unpack(members)) end
end
redis.call('HSET', KEYS[6], unpack(meta_fields))
redis.call('HSET', KEYS[7], unpack(owner_fields))
redis.call('ZADD', KEYS[8], int(lease_deadline), batch_id)
redis.call('HSET', KEYS[9], batch_id, consumer .. '|' .. table.concat(ids, ','))
redis.call('HINCRBY', KEYS[13], 'batches', 1)
redis.call('HINCRBY', KEYS[13], 'batched_requests', #ids)
if #waits > 0 then push_samples(KEYS[14], unpack(waits)) end
-- More work remains: wake one more idle consumer so it can take it or time its due date.
if total > #chosen then redis.call('ZADD', KEYS[11], 0, 'w') end
return reply
