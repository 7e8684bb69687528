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
--                          an exit finds its member without reading its payload; and
--                          "<L>|<tenant>" (no id holds a '|') -> that tenant's head cache
--                          at L: its first requests there, "<'=' all of them | '+' more
--                          follow>c<arrival>|<cost>|<id>,...".
--                          A pop reads the caches of the tenants it takes from in one call
--                          (instead of a range read each) and keeps what it read past what
--                          it took; every path that lists or unlists a request keeps the
--                          cache exact or deletes it (absent: read by range)

local FAIR_DEFAULT = 'default'  -- wire.DEFAULT_TENANT: requests that name no tenant
-- Tenants read past the lowest counters, at most, when tenants at their max_in_flight are
-- passed over (bounded work per pop).
local FAIR_SKIP = 1024
-- Requests a range read fetches into a tenant's head cache, at least, and the cache keeps,
-- at most: a pop reads the caches of the tenants it takes from in one call, and reads a
-- tenant's requests by range only once its cache runs out.
local FAIR_HEAD, FAIR_CACHED = 8, 32

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

-- The fair:who field of tenant t's head cache at `level` (no request id holds a '|').
local function fair_field(level, t)
  return level .. '|' .. t
end

-- The arrival (17 digits) and id of the last entry of a head cache's entries (anchored on
-- the reversed string: a pattern ending in '$' would be tried from every position).
local function fair_last(entries)
  local id, a = string.match(string.reverse(entries), '^,([^,|]*)|%d+|(%d+)')
  if not id then return nil end
  return string.reverse(a), string.reverse(id)
end

-- A head cache's value as read from fair:who: nil if absent, false if not of this format
-- (its second character 'c': the entries hold costs, whatever the mode).
local function fair_cached(f, raw)
  if not raw then return nil end
  if string.sub(raw, 2, 2) ~= 'c' then return false end
  return raw
end

-- Requests start waiting: entries {level, tenant (nil: the default), arrival, id}; those of
-- the delayed set (level 3) are not listed, nor an id no producer makes (written by hand:
-- its level is then taken in arrival order until it leaves). A head cache stays exact: it
-- learns that more follow where each new request arrived after its last, else it goes.
local function fair_list(f, entries)
  if not f then return end
  local members, who, touched = {{}, {}, {}}, {}, {}
  local joins = {}  -- {level, tenant, oldest arrival}, once each
  for _, e in ipairs(entries) do
    local level, t = e[1], e[2] or FAIR_DEFAULT
    if level <= 2 and valid_id(e[4]) then
      local m = members[level + 1]
      m[#m + 1] = 0
      m[#m + 1] = fair_member(t, e[3], e[4])
      who[#who + 1] = e[4]
      who[#who + 1] = t
      local k = level .. '|' .. t
      local j = touched[k]
      if not j then
        j = {level, t, tonumber(e[3])}
        touched[k] = j
        joins[#joins + 1] = j
      elseif tonumber(e[3]) < j[3] then
        j[3] = tonumber(e[3])
      end
    end
  end
  if #joins == 0 then return end
  for level = 1, 3 do
    if #members[level] > 0 then call_in_chunks('ZADD', f.sets[level], members[level]) end
  end
  call_in_chunks('HSET', f.who, who)
  local fields = {}
  for i, j in ipairs(joins) do fields[i] = fair_field(j[1], j[2]) end
  local cached, drop, flip = read_in_chunks('HMGET', f.who, fields), {}, {}
  for i, j in ipairs(joins) do
    local v = cached[i]
    if v then
      local last = fair_last(v)
      if not last or j[3] <= tonumber(last) then
        drop[#drop + 1] = fields[i]
      elseif string.sub(v, 1, 1) == '=' then
        flip[#flip + 1] = fields[i]
        flip[#flip + 1] = '+' .. string.sub(v, 2)
      end
    end
  end
  if #drop > 0 then call_in_chunks('HDEL', f.who, drop) end
  if #flip > 0 then call_in_chunks('HSET', f.who, flip) end
  for _, j in ipairs(joins) do fair_join(f, j[1], j[2]) end
end

-- After requests left the fair sets: groups {level, t, gone = {id -> true}}, each a
-- tenant's requests that left a level. Its head cache loses them; the tenant leaves the
-- level's counters where it has none left there (known from the cache where it lists
-- them all, else read).
local function fair_settle(f, groups)
  if #groups == 0 then return end
  local fields = {}
  for i, g in ipairs(groups) do fields[i] = fair_field(g[1], g[2]) end
  local cached, drop, keep = read_in_chunks('HMGET', f.who, fields), {}, {}
  for i, g in ipairs(groups) do
    local v, read = fair_cached(f, cached[i]), true
    if v then
      local kept, hit = {}, false
      for entry, id in string.gmatch(string.sub(v, 3), '(%d+|%d+|([^,]*)),') do
        if g.gone[id] then hit = true else kept[#kept + 1] = entry end
      end
      if hit and #kept > 0 then
        keep[#keep + 1] = fields[i]
        keep[#keep + 1] = string.sub(v, 1, 2) .. table.concat(kept, ',') .. ','
        read = false
      elseif hit and string.sub(v, 1, 1) == '=' then  -- its last ones left
        drop[#drop + 1] = fields[i]
        redis.call('ZREM', f.counters[g[1] + 1], g[2])
        read = false
      elseif not hit and string.sub(v, 1, 1) == '+' then
        read = false  -- they were past the cache: its first ones still wait
      else
        drop[#drop + 1] = fields[i]
      end
    elseif v == false then
      drop[#drop + 1] = fields[i]
    end
    if read then fair_leave(f, g[1], g[2]) end
  end
  if #drop > 0 then call_in_chunks('HDEL', f.who, drop) end
  if #keep > 0 then call_in_chunks('HSET', f.who, keep) end
end

-- Members (per level) leave the fair sets and ids `gone` leave who; then the tenants in
-- `groups` settle (fair_settle).
local function fair_remove(f, members, gone, groups)
  for level = 1, 3 do
    if #members[level] > 0 then call_in_chunks('ZREM', f.sets[level], members[level]) end
  end
  if #gone > 0 then call_in_chunks('HDEL', f.who, gone) end
  fair_settle(f, groups)
end

-- Requests stop waiting: entries {level, arrival, id}; `tenants` (optional) their tenants
-- by index, else read from who. Those not listed (delayed, retried, listed before
-- fairness was on) are passed over.
local function fair_unlist(f, entries, tenants)
  if not f or #entries == 0 then return end
  if not tenants then
    local ids = {}
    for i, e in ipairs(entries) do ids[i] = e[3] end
    tenants = read_in_chunks('HMGET', f.who, ids)
  end
  local members, gone, by_key, groups = {{}, {}, {}}, {}, {}, {}
  for i, e in ipairs(entries) do
    local t = tenants[i]
    if t and e[1] <= 2 then
      local m = members[e[1] + 1]
      m[#m + 1] = fair_member(t, e[2], e[3])
      gone[#gone + 1] = e[3]
      local k = e[1] .. '|' .. t
      local g = by_key[k]
      if not g then
        g = {e[1], t, gone = {}}
        by_key[k] = g
        groups[#groups + 1] = g
      end
      g.gone[e[3]] = true
    end
  end
  fair_remove(f, members, gone, groups)
end

-- Aging moved request `id` (arrival `score`) from level `from` to `to`.
local function fair_move(f, from, to, id, score)
  if not f then return end
  local t = redis.call('HGET', f.who, id)
  if not t then return end
  fair_unlist(f, {{from, score, id}}, {t})
  fair_list(f, {{to, t, score, id}})
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

-- The cost each request counts for: 1, or (fairness = cost, or `costs`) its cost from the
-- costs hash (1 where it has no entry).
local function fair_units(f, ids, costs)
  local units = {}
  if (f.mode ~= 'cost' and not costs) or #ids == 0 then
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
-- limit. Each {t, c (counter), r (rank), w (weight), room (requests it may still take)},
-- with its head cache (fair_next reads it).
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
  if #found == 0 then return found end
  local fields = {}
  for i, e in ipairs(found) do fields[i] = fair_field(level, e.t) end
  local cached = read_in_chunks('HMGET', f.who, fields)
  for i, e in ipairs(found) do
    local v = fair_cached(f, cached[i])
    -- buf: the tenant's first requests at the level, "<arrival>|<cost>|<id>," each; pos:
    -- the next one not yet taken; more: whether others follow the buf's last.
    e.buf, e.pos, e.more, e.taken, e.ends = '', 1, true, {}, {}
    if v then e.buf, e.more = string.sub(v, 3), string.sub(v, 1, 1) == '+' end
  end
  return found
end

-- Read up to `want` more of tenant e's requests at the level into its buf, past its last.
local function fair_read(f, e, set, want)
  local from = '[' .. e.t .. '|'
  if e.buf ~= '' then
    if not e.last then
      local a, id = fair_last(e.buf)
      e.last = e.t .. '|' .. a .. '|' .. id
    end
    from = '(' .. e.last
  end
  local items = redis.call('ZRANGEBYLEX', set, from, '(' .. e.t .. '}', 'LIMIT', 0, want)
  e.more, e.fresh = #items == want, true
  if #items == 0 then return end
  e.last = items[#items]
  local ids, arrivals, at = {}, {}, #e.t + 2
  for i, m in ipairs(items) do arrivals[i], ids[i] = string.match(m, '^(%d+)|(.*)$', at) end
  local units = fair_units(f, ids, true)  -- costs, whatever the mode: kept in the cache
  for i = 1, #ids do items[i] = arrivals[i] .. '|' .. units[i] .. '|' .. ids[i] .. ',' end
  e.buf = e.buf .. table.concat(items)
end

-- Tenant e's next request at the level, from its buf (read on where it runs out): its
-- arrival (17 digits), unit and id; nil if it has none left.
local function fair_next(f, e, set, want)
  if e.pos > #e.buf then
    if not e.more then return nil end
    fair_read(f, e, set, want)
    if e.pos > #e.buf then return nil end
  end
  local a, unit, id, after = string.match(e.buf, '^(%d+)|(%d+)|([^,]*),()', e.pos)
  e.pos = after
  e.taken[#e.taken + 1] = id
  e.ends[#e.ends + 1] = after
  return a, tonumber(unit), id
end

-- Level `level`'s requests in fair order, the first n, as a pending zset's head {id,
-- arrival, ...}: each next request is the oldest of the tenant whose counter, with what
-- this order gave it so far (its unit / weight per request), is lowest.
local function fair_order(f, level, n)
  local heap, out = fair_tenants(f, level, n), {}
  local set = f.sets[level + 1]
  -- What commit reuses: each tenant read (its counter, its buf), and which one gave each
  -- request, with its unit.
  f.read, f.by_id, f.unit_of = f.read or {}, f.by_id or {}, f.unit_of or {}
  for _, e in ipairs(heap) do f.read[level .. '|' .. e.t] = e end
  while #out < 2 * n and #heap > 0 do
    local e = heap[1]
    local a, unit, id = fair_next(f, e, set, math.max(FAIR_HEAD, math.min(n - #out / 2,
                                                                          2 * #e.taken)))
    if not a then
      fair_drop_top(heap)  -- none left (the counters listed it past its last)
    else
      out[#out + 1] = id
      out[#out + 1] = a
      f.by_id[id] = e
      if f.mode ~= 'cost' then unit = 1 end
      f.unit_of[id] = unit
      e.c = e.c + unit / e.w
      e.room = e.room - 1
      if e.room <= 0 or (not e.more and e.pos > #e.buf) then
        fair_drop_top(heap)
      else
        fair_sift(heap, 1)
      end
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

-- What tenant e's head cache holds once `ids` (requests fair_next gave) leave: the rest of
-- its buf, read on past it where it ran out; '' if the tenant has none left.
local function fair_rest(f, e, ids, set)
  local rest, gone = nil, {}
  for _, id in ipairs(ids) do gone[id] = true end
  local m = #ids
  if m <= #e.taken then
    rest = string.sub(e.buf, e.ends[m])
    for j = 1, m do
      if not gone[e.taken[j]] then rest = nil break end
    end
  end
  if not rest then  -- not its first ones (a cost bucket's group): the others stay
    local kept = {}
    for entry, id in string.gmatch(e.buf, '(%d+|%d+|([^,]*)),') do
      if not gone[id] then kept[#kept + 1] = entry .. ',' end
    end
    rest = table.concat(kept)
  end
  if rest == '' and e.more then
    local before = #e.buf
    fair_read(f, e, set, FAIR_HEAD)
    rest = string.sub(e.buf, before + 1)
  end
  return rest
end

-- A head cache's value: flag '=' (it lists all the tenant's requests at the level) or '+',
-- 'c' (its entries hold costs), then at most FAIR_CACHED requests.
local function fair_cache_value(more, rest)
  if #rest > FAIR_CACHED * 24 then  -- an entry is 24 characters at least
    local at = 0
    for _ = 1, FAIR_CACHED do
      at = string.find(rest, ',', at + 1, true)
      if not at then break end
    end
    if at and at < #rest then rest, more = string.sub(rest, 1, at), true end
  end
  return (more and '+' or '=') .. 'c' .. rest
end

-- A batch leaves waiting (pop_batch's commit): each request's tenant's counter at its level
-- grows by its unit / weight, in batch order, then they leave the index. Tenants
-- fair_order read keep what it read of theirs as their head cache.
local function fair_commit(f, chosen)
  if not f then return end
  local entries, ask = {}, {}
  local by_id, unit_of, read = f.by_id or {}, f.unit_of or {}, f.read or {}
  for _, c in ipairs(chosen) do
    if c.level <= 2 then
      entries[#entries + 1] = {c.level, c.score, c.id}
      if not by_id[c.id] then ask[#ask + 1] = c.id end
    end
  end
  if #entries == 0 then return end
  if #ask > 0 then  -- not from fair_order (a level taken in arrival order)
    local tenants, units = read_in_chunks('HMGET', f.who, ask), fair_units(f, ask)
    for i, id in ipairs(ask) do
      if tenants[i] then by_id[id], unit_of[id] = {t = tenants[i]}, units[i] end
    end
  end
  local groups, order, tenants = {}, {}, {}
  for i, e in ipairs(entries) do
    local src = by_id[e[3]]
    tenants[i] = src and src.t
    if src then
      local k = e[1] .. '|' .. src.t
      local g = groups[k]
      if not g then
        local known = read[k]
        g = {e[1], src.t, k = k, ids = {}, gone = {}, src = src,
             c = known and known.c0
                 or tonumber(redis.call('ZSCORE', f.counters[e[1] + 1], src.t)) or false}
        groups[k] = g
        order[#order + 1] = g
      end
      if g.src ~= src then g.src = false end
      g.ids[#g.ids + 1] = e[3]
      g.gone[e[3]] = true
      if g.c then g.c = g.c + unit_of[e[3]] / fair_quota(f, src.t) end
    end
  end
  local writes, leave, cache, drop, others = {{}, {}, {}}, {{}, {}, {}}, {}, {}, {}
  for _, g in ipairs(order) do
    local e, rest = g.src, nil
    if e and read[g.k] == e then
      rest = fair_rest(f, e, g.ids, f.sets[g[1] + 1])
      e.cached = true
      if rest == '' then
        table.insert(leave[g[1] + 1], g[2])  -- its last ones: it leaves the level
        drop[#drop + 1] = fair_field(g[1], g[2])
      else
        cache[#cache + 1] = fair_field(g[1], g[2])
        cache[#cache + 1] = fair_cache_value(e.more, rest)
      end
    else
      others[#others + 1] = g
    end
    if g.c and not (e and read[g.k] == e and rest == '') then
      local w = writes[g[1] + 1]
      w[#w + 1] = string.format('%.17g', g.c)
      w[#w + 1] = g[2]
    end
  end
  for k, e in pairs(read) do  -- read by range, none taken: cache what was read
    if e.fresh and not e.cached and e.buf ~= '' then
      cache[#cache + 1] = fair_field(tonumber(string.sub(k, 1, 1)), e.t)
      cache[#cache + 1] = fair_cache_value(e.more, e.buf)
    end
  end
  for level = 1, 3 do
    if #writes[level] > 0 then redis.call('ZADD', f.counters[level], 'XX', unpack(writes[level])) end
    if #leave[level] > 0 then redis.call('ZREM', f.counters[level], unpack(leave[level])) end
  end
  if #cache > 0 then call_in_chunks('HSET', f.who, cache) end
  if #drop > 0 then call_in_chunks('HDEL', f.who, drop) end
  -- Out of the sets and who; the other tenants' caches and counters follow (fair_settle).
  local members, gone = {{}, {}, {}}, {}
  for i, e in ipairs(entries) do
    if tenants[i] then
      local m = members[e[1] + 1]
      m[#m + 1] = fair_member(tenants[i], e[2], e[3])
      gone[#gone + 1] = e[3]
    end
  end
  fair_remove(f, members, gone, others)
end

-- The oldest of candidates {id, score, level} (a fair order is not in arrival order).
local function fair_oldest(group)
  local first = group[1]
  for _, c in ipairs(group) do
    if c.score < first.score then first = c end
  end
  return first
end
