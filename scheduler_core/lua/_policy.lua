-- The queue policy's rules, inlined where a script says "-- @include _policy.lua" (after
-- _common.lua).

-- STRATEGIES, LIMITS (each integer field's {min, max}), CHOICES (each string field's
-- values), MAX_COST_BUCKETS, MAX_REQUEST_COST, policy_range(field) (min, max as code),
-- TENANT_QUOTAS (each tenant quota's max), MAX_TENANT_QUOTAS and DEFAULT_TENANT are
-- rendered here by scheduler_core/scripts.py from scheduler_core/policy.py when the
-- scripts load: that module is their one source.
-- @render policy

-- A stored or given policy field as a number if within its limits, else nil.
local function policy_int(field, value)
  local low, high = policy_range(field)
  return low and int_arg(value, low, high)
end

-- The deadline policy's fields, as read_timeouts and timeouts_of take them.
local TIMEOUT_FIELDS = {'timeout_high_ms', 'timeout_normal_ms', 'timeout_low_ms',
                        'allow_timeout_override', 'on_timeout'}

-- The deadline policy from the values of TIMEOUT_FIELDS as read (p[first..first + 4]):
-- default timeouts per level (ms, 0 = none), whether a request's own deadline_ms
-- overrides them, and on_timeout. Fields a policy stored before they existed take their
-- defaults (none, 1, 'reject'); nil if a stored one is outside its limits.
local function timeouts_of(p, first)
  local t = {levels = {}, override = 1, on_timeout = p[first + 4] or 'reject'}
  for i = 1, 3 do
    local v = p[first + i - 1]
    t.levels[i] = v and policy_int(TIMEOUT_FIELDS[i], v) or (not v and 0)
    if not t.levels[i] then return nil end
  end
  if p[first + 3] then t.override = policy_int('allow_timeout_override', p[first + 3]) end
  if not t.override or not CHOICES.on_timeout[t.on_timeout] then return nil end
  return t
end

-- The stored deadline policy (timeouts_of), read on its own.
local function read_timeouts(policy)
  return timeouts_of(redis.call('HMGET', policy, unpack(TIMEOUT_FIELDS)), 1)
end

-- cost_buckets ("" or "32,1024": strictly increasing, each in [1, MAX_REQUEST_COST], at
-- most MAX_COST_BUCKETS) as a list of numbers, or nil if malformed.
local function parse_buckets(s)
  if s == nil or s == false or s == '' then return {} end
  if type(s) ~= 'string' or #s > 64 then return nil end
  local bounds = {}
  for part in string.gmatch(s .. ',', '([^,]*),') do
    local b = int_arg(part, 1, MAX_REQUEST_COST)
    if not b or (bounds[1] and b <= bounds[#bounds]) then return nil end
    bounds[#bounds + 1] = b
  end
  if #bounds > MAX_COST_BUCKETS then return nil end
  return bounds
end

-- The bucket (1-based) of a cost: the first boundary it does not exceed, else the last.
local function bucket_of(bounds, cost)
  for i, bound in ipairs(bounds) do
    if cost <= bound then return i end
  end
  return #bounds + 1
end

-- The stored policy's cost_buckets boundaries; {} without them (or if malformed:
-- pop_batch refuses such a policy anyway).
local function stored_bounds(policy)
  return parse_buckets(redis.call('HGET', policy, 'cost_buckets')) or {}
end

-- The number of cost buckets: the boundaries + 1; 0 without them (no bucket key is
-- written then).
local function bucket_count(bounds)
  return #bounds > 0 and #bounds + 1 or 0
end
