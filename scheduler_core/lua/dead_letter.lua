--[[ dead_letter: retry or purge dead-lettered requests (`batchgate dead-letter`).

KEYS[1]  {bg:q}:dead          zset   dead-lettered id -> time (µs)
KEYS[2]  {bg:q}:dead:reason   hash   id -> error envelope
KEYS[3]  {bg:q}:jobs          hash   id -> request envelope
KEYS[4]  {bg:q}:meta          hash   id -> meta
KEYS[5]  {bg:q}:pending:0     zset   HIGH
KEYS[6]  {bg:q}:pending:1     zset   NORMAL
KEYS[7]  {bg:q}:pending:2     zset   LOW
KEYS[8]  {bg:q}:clock         string last arrival score issued
KEYS[9]  {bg:q}:marker        zset   wake-up marker for idle consumers
KEYS[10] {bg:q}:stats         hash   counters (dead_retried, dead_purged)
KEYS[10+i] {bg:q}:result:<id_i>  the stored result of request i (for i = 1..n)

ARGV[1]  action: 'retry' | 'purge'
ARGV[2]  n, the number of ids (1..1000)
ARGV[3..2+n] request ids

retry  the request is enqueued again as a new arrival at its original priority, with
       its attempts reset, no deadline and no producer (the producer already received
       its DeadLettered result; the new one is fetched by id); its stored result is
       deleted until then. An entry without a stored request envelope stays dead.
purge  the request's envelope, meta and dead-letter entry are deleted.

Returns  {done, skipped}: ids acted on; ids skipped (not dead-lettered, or not retryable)
Errors   {-3, field} malformed argument, nothing written
Work is bounded by n.
]]
-- @include _common.lua

local action = ARGV[1]
if action ~= 'retry' and action ~= 'purge' then return {-3, 'action'} end
local n = int_arg(ARGV[2], 1, 1000)
if not n or #ARGV ~= 2 + n or #KEYS ~= 10 + n then return {-3, 'n'} end

local done, skipped = 0, 0
local now, last = nil, nil
for i = 1, n do
  local id = ARGV[2 + i]
  if not redis.call('ZSCORE', KEYS[1], id) then
    skipped = skipped + 1
  elseif action == 'purge' then
    redis.call('ZREM', KEYS[1], id)
    redis.call('HDEL', KEYS[2], id)
    redis.call('HDEL', KEYS[3], id)
    redis.call('HDEL', KEYS[4], id)
    done = done + 1
  elseif id == '' or string.find(id, '[:|,]') or redis.call('HEXISTS', KEYS[3], id) == 0 then
    skipped = skipped + 1
  else
    if not now then
      now = now_us()
      last = tonumber(redis.call('GET', KEYS[8]) or '0') or 0
    end
    local m = parse_meta(redis.call('HGET', KEYS[4], id))
    local prio = (m and m.prio) or 1
    local arrival = math.max(now, last + 1)
    last = arrival
    redis.call('HSET', KEYS[4], id, format_meta({prio = prio, arrival = arrival, deadline = 0,
                                                 attempts = 0, producer = ''}))
    redis.call('ZADD', KEYS[5 + prio], int(arrival), id)
    redis.call('ZREM', KEYS[1], id)
    redis.call('HDEL', KEYS[2], id)
    redis.call('DEL', KEYS[10 + i])
    done = done + 1
  end
end
if done > 0 then
  if action == 'retry' then
    redis.call('SET', KEYS[8], int(last))
    redis.call('ZADD', KEYS[9], 0, 'w')
    redis.call('HINCRBY', KEYS[10], 'dead_retried', done)
  else
    redis.call('HINCRBY', KEYS[10], 'dead_purged', done)
  end
end
return {done, skipped}
