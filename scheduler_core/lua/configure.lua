--[[ configure: store a queue's policy, atomically.

KEYS[1..43] the queue's shared keys, in the order of scheduler_core.keys.SHARED_KEYS;
            this script uses:
KEYS[1]  {bg:q}:policy   hash
KEYS[5]  {bg:q}:jobs     hash   read by 'retire': the requests the queue holds
KEYS[6]  {bg:q}:costs    hash   where cost_buckets changes and requests wait: its RELIST
                                field set to '0' (the pops move every waiting request to
                                the bucket set the new boundaries name, a bounded step each)
KEYS[37..39] {bg:q}:fair:<0..2> zset  the fair index (lua/_fair.lua): unlinked when
                                fairness becomes none (nothing keeps it up to date then)
KEYS[40..42] {bg:q}:vtc:<0..2> zset  the same
KEYS[43] {bg:q}:fair:who hash   the same

ARGV[1]  mode: 'ensure' (write only if the queue has no policy yet) | 'replace' |
         'retire' (a shard that `policy set --shards` drops: set the policy's field
         retired=1, so that enqueue refuses new requests, only while the queue holds no
         request, waiting, running or dead-lettered) | 'restore' (remove retired)
ARGV[2..] ('ensure', 'replace' only) field, value pairs: strategy and every field of LIMITS (rendered from
         scheduler_core.policy.LIMITS), each within its range (scheduler_core.policy.Policy
         validates them first); delay_mode, over_cost, cost_mode and on_timeout, if given, one of
         CHOICES; cost_buckets, if given, "" or increasing boundaries "32,1024";
         tenant_quotas, if given, as policy.parse_tenant_quotas reads its stored form; other
         fields are kept if their name is [a-z_] and their value at most 256 bytes

Returns  {written (0|1), field, value, ...}: the policy now stored ('ensure', 'replace');
         {1} retired or restored; {-1, held} not retired: the queue holds `held` requests
Errors   {-3, field} malformed argument, nothing written
]]
-- @include _common.lua
-- @include _policy.lua
-- @include _tenants.lua
-- @include _fair.lua
-- @include _queue.lua

local policy = KEYS[1]
local jobs = KEYS[5]
local costs = KEYS[6]
local fair_sets = {KEYS[37], KEYS[38], KEYS[39]}
local fair_counters = {KEYS[40], KEYS[41], KEYS[42]}
local fair_who = KEYS[43]

local mode = ARGV[1]
if mode == 'retire' then
  -- Checked and set in one call: no enqueue can slip in between.
  local held = redis.call('HLEN', jobs)
  if held > 0 then return {-1, held} end
  redis.call('HSET', policy, 'retired', '1')
  return {1}
elseif mode == 'restore' then
  redis.call('HDEL', policy, 'retired')
  return {1}
end
if mode ~= 'ensure' and mode ~= 'replace' then return {-3, 'mode'} end
if (#ARGV - 1) % 2 ~= 0 or #ARGV < 3 then return {-3, 'fields'} end
local given = {}
for i = 2, #ARGV, 2 do
  local field, value = ARGV[i], ARGV[i + 1]
  if field == 'strategy' then
    if not STRATEGIES[value] then return {-3, field} end
  elseif LIMITS[field] then
    if not policy_int(field, value) then return {-3, field} end
  elseif CHOICES[field] then
    if not CHOICES[field][value] then return {-3, field} end
  elseif field == 'cost_buckets' then
    if not parse_buckets(value) then return {-3, field} end
  elseif field == 'tenant_quotas' then
    if not valid_tenant_quotas(value) then return {-3, 'tenant_quotas'} end
  elseif #field > 64 or not string.match(field, '^[a-z_]+$') or #value > 256 then
    return {-3, 'fields'}
  end
  given[field] = true
end
if not given['strategy'] then return {-3, 'strategy'} end
for field in pairs(LIMITS) do
  if not given[field] then return {-3, field} end
end
local written = 0
if mode == 'replace' or redis.call('EXISTS', policy) == 0 then
  local before = parse_buckets(redis.call('HGET', policy, 'cost_buckets')) or {}
  redis.call('DEL', policy)
  redis.call('HSET', policy, unpack(ARGV, 2))
  written = 1
  local after = parse_buckets(redis.call('HGET', policy, 'cost_buckets')) or {}
  if not fair_index(redis.call('HGET', policy, 'fairness'), fair_sets, fair_counters,
                    fair_who) then
    redis.call('UNLINK', fair_who, unpack(fair_sets))
    redis.call('UNLINK', unpack(fair_counters))
  end
  if table.concat(before, ',') ~= table.concat(after, ',')
     and redis.call('EXISTS', costs) == 1 then
    redis.call('HSET', costs, RELIST, '0')  -- from the start, even if a relist was under way
  end
end
local reply = {written}
for _, v in ipairs(redis.call('HGETALL', policy)) do reply[#reply + 1] = v end
return reply
