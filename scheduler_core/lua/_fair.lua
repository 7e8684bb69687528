-- Fair share between tenants inside each priority level (docs/tenants.md, "Fair share"),
-- inlined where a script says "-- @include _fair.lua" (after _tenants.lua, before
-- _queue.lua). Only under the policy's fairness = requests | cost: with none (the
-- default) fair_index is nil and nothing here reads or writes a key.
-- Shared keys KEYS[37..43], per level 0-2 (HIGH, NORMAL, LOW; the delayed set has none):
--   {bg:q}:fair:<L>  zset  each request waiting at L as "<tenant>|<arrival, 17 digits>|<id>",
--                          score 0: ZRANGEBYLEX [t| (t} is tenant t's, in arrival order
--                          (a tenant name has no '|' and no character above '|')
--   {bg:q}:vtc:<L>   zset  tenant -> virtual counter: its weighted service at L, for the
--                          tenants with requests waiting at L only (a tenant leaves with
--                          its last one, and its counter is forgotten)
--   {bg:q}:fair:who  hash  id -> tenant of each listed request, so that an aging move or
--                          an exit finds its member without reading its payload

local FAIR_DEFAULT = 'default'  -- wire.DEFAULT_TENANT: requests that name no tenant
-- Tenants read past the lowest counters, at most, when tenants at their max_in_flight are
-- passed over (bounded work per pop).
local FAIR_SKIP = 1024

-- The queue's fair index (mode 'requests' or 'cost', the policy's fairness), or nil.
local function fair_index(mode, sets, counters, who)
  if mode ~= 'requests' and mode ~= 'cost' then return nil end
  return {mode = mode, sets = sets, counters = counters, who = who}
end

-- The index of a script that does not read the policy otherwise.
local function fair_open(policy, sets, counters, who)
  return fair_index(redis.call('HGET', policy, 'fairness'), sets, counters, who)
end

local function fair_member(t, arrival, id)
  return t .. '|' .. string.format('%017d', arrival) .. '|' .. id
end

-- Tenant t has a request at `level` now: if it had none, it joins the backlogged tenants
-- with the smallest counter among them (0 if none): time idle earns it no credit.
local function fair_join(f, level, t)
  local key = f.counters[level + 1]
  if redis.call('ZSCORE', key, t) then return end
  local low = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')[2]
  redis.call('ZADD', key, low or '0', t)
end

-- Tenant t may have no request left at `level`: then it leaves the backlogged tenants.
local function fair_leave(f, level, t)
  local left = redis.call('ZRANGEBYLEX', f.sets[level + 1], '[' .. t .. '|', '(' .. t .. '}',
                          'LIMIT', 0, 1)
  if not left[1] then redis.call('ZREM', f.counters[level + 1], t) end
end

-- Requests start waiting: entries {level, tenant (nil: the default), arrival, id}; those of
-- the delayed set (level 3) are not listed.
local function fair_list(f, entries)
  if not f then return end
  local members, who, seen, joins = {{}, {}, {}}, {}, {}, {}
  for _, e in ipairs(entries) do
    local level, t = e[1], e[2] or FAIR_DEFAULT
    if level <= 2 then
      local m = members[level + 1]
      m[#m + 1] = 0
      m[#m + 1] = fair_member(t, e[3], e[4])
      who[#who + 1] = e[4]
      who[#who + 1] = t
      local k = level .. '|' .. t
      if not seen[k] then
        seen[k] = true
        joins[#joins + 1] = {level, t}
      end
    end
  end
  for level = 1, 3 do
    if #members[level] > 0 then call_in_chunks('ZADD', f.sets[level], members[level]) end
  end
  if #who > 0 then call_in_chunks('HSET', f.who, who) end
  for _, j in ipairs(joins) do fair_join(f, j[1], j[2]) end
end

-- Requests stop waiting: entries {level, arrival, id}; `tenants` (optional) their tenants
-- by index, else read from who; `known` (optional): "<level>|<tenant>" -> true where
-- fair_commit settled whether it leaves. Those not listed (delayed, retried, listed before
-- fairness was on) are passed over.
local function fair_unlist(f, entries, tenants, known)
  if not f or #entries == 0 then return end
  if not tenants then
    local ids = {}
    for i, e in ipairs(entries) do ids[i] = e[3] end
    tenants = read_in_chunks('HMGET', f.who, ids)
  end
  local members, gone, seen, leaves = {{}, {}, {}}, {}, {}, {}
  for i, e in ipairs(entries) do
    local t = tenants[i]
    if t and e[1] <= 2 then
      local m = members[e[1] + 1]
      m[#m + 1] = fair_member(t, e[2], e[3])
      gone[#gone + 1] = e[3]
      local k = e[1] .. '|' .. t
      if not seen[k] then
        seen[k] = true
        leaves[#leaves + 1] = {e[1], t}
      end
    end
  end
  for level = 1, 3 do
    if #members[level] > 0 then call_in_chunks('ZREM', f.sets[level], members[level]) end
  end
  if #gone > 0 then call_in_chunks('HDEL', f.who, gone) end
  for _, l in ipairs(leaves) do
    -- Known to fair_order (a pop's commit): it left above, or still has requests there.
    if not (known and known[l[1] .. '|' .. l[2]]) then fair_leave(f, l[1], l[2]) end
  end
end

-- Aging moved request `id` (arrival `score`) from level `from` to `to`.
local function fair_move(f, from, to, id, score)
  if not f then return end
  local t = redis.call('HGET', f.who, id)
  if not t then return end
  local member = fair_member(t, score, id)
  redis.call('ZREM', f.sets[from + 1], member)
  fair_leave(f, from, t)
  redis.call('ZADD', f.sets[to + 1], 0, member)
  fair_join(f, to, t)
end

-- Tenant t's weight and max_in_flight (0: none) from tenant_quotas; the default tenant has
-- weight 1 and no limit. Memoized per call.
local function fair_quota(f, t)
  f.quota_of = f.quota_of or {}
  local q = f.quota_of[t]
  if not q then
    q = {1, 0}
    if t ~= FAIR_DEFAULT then
      local got = tenant_quota(f.quotas, t)
      q = {(got.weight or 0) > 0 and got.weight or 1, got.max_in_flight or 0}
    end
    f.quota_of[t] = q
  end
  return q[1], q[2]
end

-- The cost each request counts for: 1, or (fairness = cost) its cost from the costs hash
-- (1 where it has no entry).
local function fair_units(f, ids)
  local units = {}
  if f.mode ~= 'cost' or #ids == 0 then
    for i = 1, #ids do units[i] = 1 end
    return units
  end
  local raw = read_in_chunks('HMGET', f.costs, ids)
  for i = 1, #ids do  -- "<cost>:<bucket>:<prio>" (_queue.lua's cost_record)
    units[i] = tonumber(raw[i] and string.match(raw[i], '^(%d+):') or '1') or 1
  end
  return units
end

-- Binary heap of tenants by (counter, rank): rank is the order read from the counters
-- zset (score, then name as bytes), so ties break as Redis orders them.
local function fair_before(a, b)
  return a.c < b.c or (a.c == b.c and a.r < b.r)
end

local function fair_sift(heap, i)
  local n = #heap
  while true do
    local l, r, m = 2 * i, 2 * i + 1, i
    if l <= n and fair_before(heap[l], heap[m]) then m = l end
    if r <= n and fair_before(heap[r], heap[m]) then m = r end
    if m == i then return end
    heap[i], heap[m] = heap[m], heap[i]
    i = m
  end
end

local function fair_drop_top(heap)
  heap[1] = heap[#heap]
  heap[#heap] = nil
  if #heap > 1 then fair_sift(heap, 1) end
end

-- The backlogged tenants of `level` that may run more (below their max_in_flight), in
-- counter order: the first n of them, reading at most FAIR_SKIP more past those at their
-- limit. Each {t, c (counter), r (rank), w (weight), room (requests it may still take)}.
local function fair_tenants(f, level, n)
  local key, found, read = f.counters[level + 1], {}, 0
  while #found < n and read < n + FAIR_SKIP do
    local want = math.min(n - #found, n + FAIR_SKIP - read)
    local page = redis.call('ZRANGE', key, read, read + want - 1, 'WITHSCORES')
    local limited, fields = {}, {}
    for i = 1, #page, 2 do
      read = read + 1
      local t = page[i]
      local w, limit = fair_quota(f, t)
      local c = tonumber(page[i + 1])
      local e = {t = t, c = c, c0 = c, r = read, w = w, room = math.huge}
      if limit > 0 then
        e.room = limit
        limited[#limited + 1] = e
        fields[#fields + 1] = 'f:' .. t
      end
      page[i] = e
    end
    local flying = #fields > 0 and redis.call('HMGET', f.tenants, unpack(fields)) or {}
    for i, e in ipairs(limited) do e.room = e.room - (tonumber(flying[i]) or 0) end
    for i = 1, #page, 2 do
      if page[i].room > 0 then found[#found + 1] = page[i] else f.blocked = true end
    end
    if #page < 2 * want then break end
  end
  return found
end

-- Level `level`'s requests in fair order, the first n, as a pending zset's head {id,
-- arrival, ...}: each next request is the oldest of the tenant whose counter, with what
-- this order gave it so far (its unit / weight per request), is lowest.
local function fair_order(f, level, n)
  local heap, out = fair_tenants(f, level, n), {}
  local set = f.sets[level + 1]
  -- What commit may reuse: each tenant read's counter, and how many requests it has at
  -- the level where all were read (nil: more than were read).
  f.read = f.read or {}
  for _, e in ipairs(heap) do f.read[level .. '|' .. e.t] = e end
  while #out < 2 * n and #heap > 0 do
    local e = heap[1]
    if not e.items or e.at > #e.items then
      local want = math.min(n - #out / 2, math.max(4, 2 * (e.items and #e.items or 0)))
      local from = e.last and '(' .. e.last or '[' .. e.t .. '|'
      local items = e.done and {} or redis.call('ZRANGEBYLEX', set, from, '(' .. e.t .. '}',
                                                'LIMIT', 0, want)
      e.done = #items < want
      e.count = (e.count or 0) + #items
      if e.done then e.total = e.count end
      e.last, e.at = items[#items], 1
      e.items, e.ids = items, {}
      for i, m in ipairs(items) do
        local a, id = string.match(m, '|(%d+)|(.*)$')
        items[i], e.ids[i] = a, id
      end
      e.units = fair_units(f, e.ids)
    end
    if e.at > #e.items then
      fair_drop_top(heap)  -- none left (the counters listed it past its last)
    else
      out[#out + 1] = e.ids[e.at]
      out[#out + 1] = e.items[e.at]
      e.c = e.c + e.units[e.at] / e.w
      e.at = e.at + 1
      e.room = e.room - 1
      if e.room <= 0 or (e.done and e.at > #e.items) then fair_drop_top(heap) else fair_sift(heap, 1) end
    end
  end
  return out
end

-- pop_batch's heads under fairness: per level + 1, its first n in fair order where the
-- index lists every request waiting there; else (a level with requests listed before
-- fairness was on, or the delayed set) in arrival order.
local function fair_heads(f, count, levels, n)
  local got = {}
  for _, level in ipairs(levels) do
    if count[level + 1] > 0 then
      if level <= 2 and redis.call('ZCARD', f.sets[level + 1]) == count[level + 1] then
        got[level + 1] = fair_order(f, level, n)
      else
        got[level + 1] = redis.call('ZRANGE', f.pending[level + 1], 0, n - 1, 'WITHSCORES')
      end
    end
  end
  return got
end

-- A batch leaves waiting (pop_batch's commit): each request's tenant's counter at its level
-- grows by its unit / weight, in batch order, then they leave the index.
local function fair_commit(f, chosen)
  if not f then return end
  local entries, ids = {}, {}
  for _, c in ipairs(chosen) do
    if c.level <= 2 then
      entries[#entries + 1] = {c.level, c.score, c.id}
      ids[#ids + 1] = c.id
    end
  end
  if #ids == 0 then return end
  local tenants = redis.call('HMGET', f.who, unpack(ids))
  local units = fair_units(f, ids)
  local now, order, taken, read = {}, {}, {}, f.read or {}
  for i, e in ipairs(entries) do
    local t = tenants[i]
    if t then
      local k = e[1] .. '|' .. t
      if now[k] == nil then
        local known = read[k]
        now[k] = known and known.c0
                 or tonumber(redis.call('ZSCORE', f.counters[e[1] + 1], t)) or false
        order[#order + 1] = {e[1], t, k}
        taken[k] = 0
      end
      taken[k] = taken[k] + 1
      if now[k] then now[k] = now[k] + units[i] / fair_quota(f, t) end
    end
  end
  local writes, gone, settled = {{}, {}, {}}, {{}, {}, {}}, {}
  for _, o in ipairs(order) do
    local known = read[o[3]]
    -- Whether it has requests left at the level, where fair_order's reads tell.
    if known and known.total and known.total <= taken[o[3]] then
      table.insert(gone[o[1] + 1], o[2])  -- its last ones: it leaves the level
      settled[o[3]] = true
    elseif known and known.count > taken[o[3]] then
      settled[o[3]] = true
    end
    if now[o[3]] and not (known and known.total and known.total <= taken[o[3]]) then
      local w = writes[o[1] + 1]
      w[#w + 1] = string.format('%.17g', now[o[3]])
      w[#w + 1] = o[2]
    end
  end
  for level = 1, 3 do
    if #writes[level] > 0 then redis.call('ZADD', f.counters[level], 'XX', unpack(writes[level])) end
    if #gone[level] > 0 then redis.call('ZREM', f.counters[level], unpack(gone[level])) end
  end
  fair_unlist(f, entries, tenants, settled)
end

-- The oldest of candidates {id, score, level} (a fair order is not in arrival order).
local function fair_oldest(group)
  local first = group[1]
  for _, c in ipairs(group) do
    if c.score < first.score then first = c end
  end
  return first
end
