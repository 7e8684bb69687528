--[[ cancel: remove a waiting request so that it never runs.

KEYS[1]  {bg:q}:pending:0     zset
KEYS[2]  {bg:q}:pending:1     zset
KEYS[3]  {bg:q}:pending:2     zset
KEYS[4]  {bg:q}:jobs          hash
KEYS[5]  {bg:q}:meta          hash
KEYS[6]  {bg:q}:owner         hash  id -> batch id while in flight
KEYS[7]  {bg:q}:stats         hash  counters
KEYS[8]  {bg:q}:result:<id>   string
KEYS[9]  {bg:q}:inbox:<producer>  list, the producer's inbox (any key if none)
KEYS[10] {bg:q}:policy        hash  its result_ttl_s, when set, overrides ARGV[2]

ARGV[1]  request id
ARGV[2]  result TTL, seconds, if the queue has no policy
ARGV[3]  the result envelope to store and deliver ('Cancelled' or 'DeadlineExceeded')
ARGV[4]  the stats counter to count it under ('cancelled' | 'expired')

Returns  1 cancelled (result delivered), 2 already in a batch (it will run),
         0 not waiting (finished, expired or unknown)
Errors   {-3, field} malformed argument
]]
-- @include _common.lua

if ARGV[4] ~= 'cancelled' and ARGV[4] ~= 'expired' then return {-3, 'counter'} end
if not int_arg(ARGV[2], 1, 315360000) then return {-3, 'result_ttl_s'} end
if #ARGV ~= 4 or #KEYS ~= 10 then return {-3, 'args'} end
-- The queue's current result_ttl_s, as the consumers use it, not the caller's copy.
local ttl = int_arg(redis.call('HGET', KEYS[10], 'result_ttl_s'), 1, 315360000)
  or tonumber(ARGV[2])

local id = ARGV[1]
if redis.call('HEXISTS', KEYS[6], id) == 1 then return 2 end
for level = 1, 3 do
  if redis.call('ZREM', KEYS[level], id) == 1 then
    local m = parse_meta(redis.call('HGET', KEYS[5], id))
    redis.call('HDEL', KEYS[4], id)
    redis.call('HDEL', KEYS[5], id)
    redis.call('SET', KEYS[8], ARGV[3], 'EX', ttl)
    if m and m.producer ~= '' then
      redis.call('RPUSH', KEYS[9], ARGV[3])
      redis.call('EXPIRE', KEYS[9], ttl)
    end
    redis.call('HINCRBY', KEYS[7], ARGV[4], 1)
    return 1
  end
end
return 0
