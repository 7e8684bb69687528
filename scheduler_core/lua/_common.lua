-- Shared helpers, inlined by scheduler_core/scripts.py where a script says
-- "-- @include _common.lua". Not a script of its own.

-- Redis server time in microseconds: the only clock batchgate trusts.
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- Integers as exact decimal strings (tostring() would print 1.7e+15).
local function int(n)
  return string.format('%.0f', n)
end

-- meta value: "orig_prio:arrival_us:deadline_us:attempts:producer"
local function parse_meta(raw)
  if not raw then return nil end
  local p, a, d, n, producer = string.match(raw, '^(%d):(%d+):(%d+):(%d+):(.*)$')
  if not p then return nil end
  return {prio = tonumber(p), arrival = tonumber(a), deadline = tonumber(d),
          attempts = tonumber(n), producer = producer}
end

local function format_meta(m)
  return m.prio .. ':' .. int(m.arrival) .. ':' .. int(m.deadline) .. ':' ..
         int(m.attempts) .. ':' .. m.producer
end

-- batches value: "consumer|id,id,..."
local function batch_ids(raw)
  local ids = {}
  if not raw then return ids end
  local list = string.match(raw, '|(.*)$') or ''
  for id in string.gmatch(list, '[^,]+') do ids[#ids + 1] = id end
  return ids
end
