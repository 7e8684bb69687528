-- Shared helpers, inlined by scheduler_core/scripts.py where a script says
-- "-- @include _common.lua" (first of its includes). Not a script of its own.

-- Redis server time in microseconds: the only clock batchgate trusts.
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- The queue's clock (µs), which every script of a queue reads instead of TIME: TIME plus
-- the queue's offset, raised whenever TIME falls behind the latest time the queue showed
-- or issued as an arrival score. Both live in the clock key, "<latest>" or
-- "<latest>:<offset>" (offset > 0), so that a call reads and writes its clock with one
-- command each. A backward step of the server's clock (an NTP step, failover to a host
-- whose clock lags) would otherwise leave every score written before it in the future:
-- new arrivals due only after step + delay, waits, aging, leases and deadlines late by
-- the step. So the queue's clock never goes back: after a step it runs on from where it
-- was, 1% slower than TIME until the offset is repaid (100 x the step), so that a later
-- forward step (the clock set right again) finds little of it left to add. A forward
-- step is kept (nothing tells it from time passing): what waits ages by it.
-- `later`: the caller may still refuse its arguments (then it writes nothing), and calls
-- note_clock() once it writes. (The second argument is unused: the queue's stats key,
-- which held the clock before.)
local clock_now  -- this call's clock: {key, latest, offset, read (latest as stored), dirty}
local function note_clock()
  local c = clock_now
  if not c or not c.dirty then return end
  c.dirty = false
  if c.offset > 0 then
    redis.call('SET', c.key, string.format('%d:%d', c.latest, c.offset))
  else
    redis.call('SET', c.key, string.format('%d', c.latest))
  end
end

-- A stored clock value in µs; 0 for none or for one written by hand (not a number, nan,
-- negative, or beyond 2^53).
local function clock_value(s)
  local n = tonumber(s)
  if n and n >= 0 and n < 9007199254740992 then return math.floor(n) end
  return 0
end

local function queue_now(clock, _, later)
  local t = now_us()
  local raw = redis.call('GET', clock)
  local latest, offset = 0, 0
  if raw then
    local a, b = string.match(raw, '^(%d+):(%d+)$')
    if a then latest, offset = clock_value(a), clock_value(b) else latest = clock_value(raw) end
  end
  local stored = offset
  local passed = t + offset - latest  -- on the queue's clock, since its last call
  if offset > 0 and passed > 0 then offset = math.max(0, offset - math.floor(passed / 100)) end
  local now = t + offset
  if now < latest then offset, now = latest - t, latest end  -- TIME stepped back
  clock_now = {key = clock, latest = now, offset = offset, read = latest,
               dirty = now ~= latest or offset ~= stored}
  if not later then note_clock() end
  return now
end

-- An integer argument in [lo, hi] written as plain decimal digits, else nil. tonumber()
-- alone accepts 'nan', 'inf', '1e300', '0x1f' and '1.5', which would reach a command
-- (EX, ZADD, LIMIT) and fail half-way through a script, after some of its writes.
-- Most arguments are one digit (priority, flags, cost 1, no deadline): those skip the
-- pattern and tonumber()'s strtod.
local DIGIT = {['0'] = 0, ['1'] = 1, ['2'] = 2, ['3'] = 3, ['4'] = 4, ['5'] = 5, ['6'] = 6,
               ['7'] = 7, ['8'] = 8, ['9'] = 9}
local function int_arg(s, lo, hi)
  local n = DIGIT[s]
  if n then return n >= lo and n <= hi and n or nil end
  if type(s) ~= 'string' or #s > 16 or not string.match(s, '^%-?%d+$') then return nil end
  n = tonumber(s)
  if n < lo or n > hi then return nil end
  return n
end

-- A request id or producer id as producers make them (uuid hex): 1-128 characters from
-- letters, digits, '_', '.', '-'. Anything else was written by hand. Anchored patterns:
-- an unanchored search for a bad character starts a match at every position, several
-- times the cost; the class %w alone, which a producer's hex ids meet, is cheaper still.
local function valid_id(s)
  return #s <= 128 and (string.find(s, '^%w+$') or string.find(s, '^[%w_.%-]+$')) ~= nil
end

-- Integers as exact decimal strings (tostring() would print 1.7e+15). '%d' where the
-- value is a whole number Lua's long holds exactly: '%.0f' goes through the C library's
-- floating-point printer, which costs several times more (a batch makes many of them).
local function int(n)
  if n == math.floor(n) and n > -9007199254740992 and n < 9007199254740992 then
    return string.format('%d', n)
  end
  return string.format('%.0f', n)
end

-- jobs value: "<meta>|<envelope>", the request's bookkeeping and its envelope in one
-- field, so that each request is one hash field (one read at pop, one delete at the end).
-- meta: "orig_prio:arrival_us:deadline_us:attempts:keep:producer[:cost[:requested]]"
-- attempts: deliveries that ended without a result (pop does not write it: the delivery
-- in progress is attempts + 1; requeue_expired and a dead outcome count it); keep: 1 if
-- the result is also stored by id (result:<id>), 0 if it only goes to the inbox; cost
-- (default 1 when absent): the request's cost as enqueued; requested, present only when
-- over_cost=truncate capped it, the cost its producer asked for. No meta field holds '|',
-- so the first '|' ends the meta and the envelope is the rest, whatever its bytes.
local JOB_META = '^([0-2]):(%d+):(%d+):(%d+):([01]):([%w_.%-]*):?(%d*):?(%d*)|'

-- tonumber() goes through strtod, which costs more than the rest of a parse: fields that
-- are almost always '0' (deadline, attempts) or absent (cost) skip it then.
local PRIO_OF = {['0'] = 0, ['1'] = 1, ['2'] = 2}
local function digits_or_zero(s)
  if s == '0' then return 0 end
  return tonumber(s)
end

local function parse_job(raw)
  if not raw then return nil end
  local _, e, p, a, d, n, k, producer, c, r = string.find(raw, JOB_META)
  if not p or #a > 17 or #d > 17 or #n > 9 or #c > 10 or #r > 10 then
    return nil  -- absurd: by hand
  end
  if c == '' then c = '1' end
  if r == '' then r = c end
  local cost = c == '1' and 1 or tonumber(c)
  -- The digits are kept as read, so that writing the meta back formats no number.
  return {prio = PRIO_OF[p], arrival = tonumber(a), deadline = digits_or_zero(d),
          attempts = digits_or_zero(n), keep = k == '1', producer = producer, arrival_s = a,
          deadline_s = d, cost = cost, requested = r == c and cost or tonumber(r), cost_s = c,
          requested_s = r,
          envelope = string.sub(raw, e + 1)}
end

-- What a pop needs of a jobs value: its deadline (µs, 0 = none), attempts and cost; nil
-- where parse_job would find no meta. parse_job's string captures and envelope copy are
-- each a new Lua string, and over a batch those allocations cost more than the pop's
-- Redis commands: here the arrival and producer are matched by position, and what is
-- captured is almost always '0' or '' (strings Lua already holds).
local POP_FIELDS = '^[0-2]:()%d+():(%d+):(%d+):[01]:[%w_.%-]*:?(%d*):?()%d*()|'

local function pop_fields(raw)
  if not raw then return nil end
  local a0, a1, d, n, c, r0, r1 = string.match(raw, POP_FIELDS)
  if not a0 or a1 - a0 > 17 or #d > 17 or #n > 9 or #c > 10 or r1 - r0 > 10 then
    return nil
  end
  return digits_or_zero(d), digits_or_zero(n), (c == '' and 1 or tonumber(c))
end

-- What a completion needs of a jobs value, without parse_job's table and envelope copy:
-- its arrival (µs, as a number), whether its result is kept by id, and whether it has a
-- producer; nil where parse_job would find no meta. Positions, not strings, are captured
-- where the value is not needed (each captured string is a new Lua string).
local JOB_ROUTE = '^[0-2]:(%d+):()%d+():()%d+():([01]):()[%w_.%-]*():?()%d*():?()%d*()|'

local function job_route(raw)
  if not raw then return nil end
  local a, d0, d1, n0, n1, k, p0, p1, c0, c1, r0, r1 = string.match(raw, JOB_ROUTE)
  if not a or #a > 17 or d1 - d0 > 17 or n1 - n0 > 9 or c1 - c0 > 10 or r1 - r0 > 10 then
    return nil
  end
  return tonumber(a), k == '1', p1 > p0
end

-- The envelope of a jobs value, for a caller that needs no meta (the whole value if it
-- has none: written by hand).
local function job_envelope(raw)
  if not raw then return nil end
  local m = parse_job(raw)
  return m and m.envelope or raw
end

-- The digits of the small numbers a meta holds most often, without string.format.
local SMALL = {[0] = '0', '1', '2', '3', '4', '5', '6', '7', '8', '9'}

local function format_job(m)
  local raw = (SMALL[m.prio] or int(m.prio)) .. ':' .. (m.arrival_s or int(m.arrival)) ..
              ':' .. (m.deadline_s or SMALL[m.deadline] or int(m.deadline)) .. ':' ..
              (SMALL[m.attempts] or int(m.attempts)) .. ':' .. (m.keep and '1:' or '0:') ..
              m.producer
  local cost, requested = m.cost or 1, m.requested or m.cost or 1
  if requested ~= cost then
    raw = raw .. ':' .. int(cost) .. ':' .. int(requested)
  elseif cost ~= 1 then
    raw = raw .. ':' .. int(cost)
  end  -- cost 1, the default: no cost fields
  return raw .. '|' .. m.envelope
end

-- Lua's unpack() gives at most ~8000 values (its C stack): a variadic call takes at most
-- VARIADIC_MAX values at once (even, so that field/value pairs stay whole).
local VARIADIC_MAX = 4000

-- redis.call(command, key, values...) for a write, in calls of at most VARIADIC_MAX.
local function call_in_chunks(command, key, values)
  for first = 1, #values, VARIADIC_MAX do
    redis.call(command, key, unpack(values, first, math.min(#values, first + VARIADIC_MAX - 1)))
  end
end

-- The reply of a read of many values (HMGET, ZMSCORE), in calls of at most VARIADIC_MAX.
local function read_in_chunks(command, key, values)
  if #values <= VARIADIC_MAX then return redis.call(command, key, unpack(values)) end
  local reply = {}
  for first = 1, #values, VARIADIC_MAX do
    local part = redis.call(command, key,
                            unpack(values, first, math.min(#values, first + VARIADIC_MAX - 1)))
    for i = 1, #part do reply[#reply + 1] = part[i] end
  end
  return reply
end

-- Push recent samples to a capped list: the newest SAMPLES_KEPT stay. Trimmed only once
-- the list is SAMPLES_SLACK over, so that most calls cost one command, not two.
local SAMPLES_KEPT, SAMPLES_SLACK = 10000, 500
local function push_samples(key, ...)
  if redis.call('LPUSH', key, ...) > SAMPLES_KEPT + SAMPLES_SLACK then
    redis.call('LTRIM', key, 0, SAMPLES_KEPT - 1)
  end
end

-- The service rate window complete.lua keeps in stats (rate_since_us, rate_base: when it
-- began and the processed counter then), as HMGET read them: nil where there is none (or
-- it was written by hand).
local function read_rate_window(since, base)
  since, base = tonumber(since), tonumber(base)
  if not since or not base or since < 0 or base < 0 then return nil end
  return since, base
end
