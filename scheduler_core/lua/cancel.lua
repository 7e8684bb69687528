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

ARGV[1]  request id
ARGV[2]  result TTL, seconds
ARGV[3]  the result envelope to store and deliver ('Cancelled' or 'DeadlineExceeded')
ARGV[4]  the stats counter to count it under ('cancelled' | 'expired')

Returns  1 cancelled (result delivered), 2 already in a batch (it will run),
         0 not waiting (finished, expired or unknown)
Errors   {-3, field} malformed argument
]]
-- @include _common.lua

if ARGV[4] ~= 'cancelled' and ARGV[4] ~= 'expired' then return {-3, 'counter'} end
if not int_arg(ARGV[2], 1, 315360000) then return {-3, 'result_ttl_s'} end
if #ARGV ~= 4 or #KEYS ~= 9 then return {-3, 'args'} end

local id = ARGV[1]
if redis.call('HEXISTS', KEYS[6], id) == 1 then return 2 end
for level = 1, 3 do
  if redis.call('ZREM', KEYS[level], id) == 1 then
    local m = parse_meta(redis.call('HGET', KEYS[5], id))
    redis.call('HDEL', KEYS[4], id)
    redis.call('HDEL', KEYS[5], id)
    redis.call('SET', KEYS[8], ARGV[3], 'EX', tonumber(ARGV[2]))
    if m and m.producer ~= '' then
      redis.call('RPUSH', KEYS[9], ARGV[3])
      redis.call('EXPIRE', KEYS[9], tonumber(ARGV[2]))
    end
    redis.call('HINCRBY', KEYS[7], ARGV[4], 1)
    return 1
  end
end
return 0
