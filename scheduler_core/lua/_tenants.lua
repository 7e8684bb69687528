-- Tenants (docs/tenants.md), inlined where a script says "-- @include _tenants.lua"
-- (after _common.lua). A request of a named tenant carries it first in its envelope
-- ({"v":1,"tenant":"acme",...}, scheduler_core/wire.py); one without belongs to the
-- default tenant, which costs nothing here: no counter, no quota.
-- Two shared keys of the queue (KEYS[35], KEYS[36]):
--   {bg:q}:tenants      hash  per named tenant t: w:t waiting, f:t in flight, a:t accepted,
--                             r:t refused by a quota, s:t finished, sc:t cost finished
--   {bg:q}:tenant_rate  hash  per tenant with a rate quota: q:t, c:t token buckets
--                             (requests, cost) as "tokens:at_us" on the queue's clock

local TENANT_AT = '^{"v":1,"tenant":"([^"]*)"'
local MAX_TENANT = 64

-- The tenant of a request envelope: nil for the default tenant, false if malformed.
local function envelope_tenant(envelope)
  local t = string.match(envelope, TENANT_AT)
  if t == nil then return nil end
  if #t > MAX_TENANT or not string.find(t, '^[%w_.:%-]+$') then return false end
  return t
end

-- The tenant of a jobs value ("<meta>|<envelope>"): nil for the default tenant.
local function job_tenant(raw)
  if not raw then return nil end
  local bar = string.find(raw, '|', 1, true)
  return bar and string.match(raw, TENANT_AT, bar + 1) or nil
end

-- The tenants' keys never fail a script half-way through its writes: a value or key
-- written by hand (not a number, not a hash) is read as nothing and overwritten, or, if
-- the key is not a hash, left alone (then the counters are not kept). pcall, not call.
local function tenant_get(key, field)
  local value = redis.pcall('HGET', key, field)
  return type(value) == 'string' and value or nil
end

-- Per-tenant counter changes, gathered over a call and written at once (a read, a write
-- and a delete, however many tenants: a batch may hold dozens): add_tenant(t, field,
-- delta) counts, flush(key) writes.
local function tenant_tally()
  local deltas, order = {}, {}
  local tally = {}
  function tally.add_tenant(t, field, delta)
    local name = field .. ':' .. t
    if not deltas[name] then order[#order + 1] = name end
    deltas[name] = (deltas[name] or 0) + delta
  end
  function tally.flush(key)
    local names = {}
    for _, name in ipairs(order) do
      if deltas[name] ~= 0 then names[#names + 1] = name end
    end
    if #names == 0 then return end
    local now = redis.pcall('HMGET', key, unpack(names))
    if now.err then return end  -- not a hash (by hand): left alone
    local set, gone = {}, {}
    for i, name in ipairs(names) do
      local kept, n = now[i], deltas[name]
      -- Not an integer (by hand): start again from 0. Past 2^53 a Lua number is not exact:
      -- Redis adds.
      if kept and #kept > 15 and string.find(kept, '^%-?%d+$') then
        redis.pcall('HINCRBY', key, name, n)
      else
        if kept and string.find(kept, '^%-?%d+$') then n = n + tonumber(kept) end
        -- A gauge (w:, f:) at 0 is removed: a tenant gone idle leaves only its totals.
        if n == 0 and string.find(name, '^[wf]:') then
          gone[#gone + 1] = name
        else
          set[#set + 1] = name
          set[#set + 1] = string.format('%d', n)
        end
      end
    end
    if #set > 0 then redis.pcall('HSET', key, unpack(set)) end
    if #gone > 0 then redis.pcall('HDEL', key, unpack(gone)) end
  end
  return tally
end

-- The quota of tenant `t` from the policy's tenant_quotas ("*:rps=5;acme:max_waiting=10,
-- rps=50"; Policy validates it): its own entry, else the default '*' one; a table of
-- numbers, {} without either.
local function tenant_quota(quotas, t)
  local q = {}
  if not quotas or quotas == '' then return q end
  local all = ';' .. quotas .. ';'
  -- Tenants may hold ':': an entry is ours only where what follows `;t:` has no ':'.
  local spec = nil
  for _, name in ipairs({t, '*'}) do
    local from = 1
    while not spec do
      local at = string.find(all, ';' .. name .. ':', from, true)
      if not at then break end
      local start = at + #name + 2
      local rest = string.sub(all, start, string.find(all, ';', start, true) - 1)
      if not string.find(rest, ':', 1, true) then spec = rest end
      from = at + 1
    end
    if spec then break end
  end
  if not spec then return q end
  for key, value in string.gmatch(spec, '([%w_]+)=(%d+)') do q[key] = tonumber(value) end
  return q
end

-- Whether `value` is a tenant_quotas that scheduler_core.policy reads back: at most
-- MAX_TENANT_QUOTAS characters of entries "tenant:quota=N,..." joined by ';', each tenant
-- '*' or a tenant name other than DEFAULT_TENANT, each quota one of TENANT_QUOTAS within
-- its range (configure stores nothing else).
local function valid_tenant_quotas(value)
  if #value > MAX_TENANT_QUOTAS then return false end
  for entry in string.gmatch(value .. ';', '([^;]*);') do
    if entry ~= '' then
      local tenant, spec = string.match(entry, '^(.*):([^:]*)$')
      if not tenant or tenant == DEFAULT_TENANT or (tenant ~= '*' and
         (#tenant > MAX_TENANT or not string.find(tenant, '^[%w_.:%-]+$'))) then
        return false
      end
      for pair in string.gmatch(spec .. ',', '([^,]*),') do
        local key, digits = string.match(pair, '^([%w_]+)=(%d+)$')
        if pair ~= '' and not (key and TENANT_QUOTAS[key] and #digits <= 13
                               and tonumber(digits) <= TENANT_QUOTAS[key]) then
          return false
        end
      end
    end
  end
  return true
end

-- Take `need` tokens from the bucket `field` of hash `key` (rate per s, burst) at `now`
-- (µs). Returns ok, the state to save ("tokens:now") and, when refused, the seconds until
-- enough tokens are back.
local function take_tokens(key, field, rate, burst, need, now)
  local tokens, at = burst, now
  local kept = tenant_get(key, field)
  if kept then
    local t, a = string.match(kept, '^([%d.e+-]+):(%d+)$')
    tokens, at = tonumber(t) or burst, tonumber(a) or now
  end
  if at > now then at = now end
  tokens = math.min(burst, tokens + rate * (now - at) / 1000000)
  if tokens < need then return false, nil, (need - tokens) / rate end
  return true, string.format('%.17g:%d', tokens - need, now), 0
end
