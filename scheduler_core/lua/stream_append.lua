--[[ stream_append: append partial results of a batch's requests to their streams, fenced
by the batch id (one call per model step for the whole batch).

KEYS[1..43] the queue's shared keys, in the order of scheduler_core.keys.SHARED_KEYS;
            this script uses:
KEYS[10] {bg:q}:inflight      zset   batch id -> lease deadline
KEYS[11] {bg:q}:owner         hash   id -> batch id
KEYS[44+i] {bg:q}:stream:<id_i>  stream  the partial results of entry i's request
           (i = 0..n-1; an id may repeat, each time with its own key)

ARGV[1]  batch id (the fencing token returned by pop_batch)
ARGV[2]  TTL of a stream, seconds (the queue's result_ttl_s)
ARGV[3]  the most entries a stream keeps (MAXLEN, 1..1000000): older ones are trimmed
ARGV[4]  n, number of entries (1..MAX_STREAM_ENTRIES)
ARGV[5+3i..7+3i] for entry i: request id, kind ('p' a part, 'r' a restart marker),
         value (orjson of the part; the attempt for 'r')

Returns  {appended, refused}: entries written; entries refused because their request is
         not (or no longer) in this batch.
Errors   {-1}  stale batch: its lease expired and it was re-queued (or it never existed);
               nothing written
         {-3, field} malformed argument
Work is bounded by n (at most MAX_STREAM_ENTRIES).
]]
-- @include _common.lua

local inflight = KEYS[10]
local owner = KEYS[11]
-- KEYS[44 + i]: stream:<id> of entry i

local MAX_STREAM_ENTRIES = 4096
local batch_id = ARGV[1]
local ttl = int_arg(ARGV[2], 1, 315360000)
if not ttl then return {-3, 'result_ttl_s'} end
local maxlen = int_arg(ARGV[3], 1, 1000000)
if not maxlen then return {-3, 'stream_maxlen'} end
local n = int_arg(ARGV[4], 1, MAX_STREAM_ENTRIES)
if not n or #ARGV ~= 4 + 3 * n or #KEYS ~= 43 + n then return {-3, 'n'} end
local kinds = {p = true, r = true}
for i = 0, n - 1 do
  if not kinds[ARGV[6 + 3 * i]] then return {-3, 'kind'} end
end
if not redis.call('ZSCORE', inflight, batch_id) then return {-1} end

local ids, unique, seen = {}, {}, {}
for i = 0, n - 1 do
  local id = ARGV[5 + 3 * i]
  ids[i + 1] = id
  if not seen[id] then
    seen[id] = true
    unique[#unique + 1] = id
  end
end
local holders = redis.call('HMGET', owner, unpack(unique))
local held = {}
for j, id in ipairs(unique) do held[id] = holders[j] == batch_id end

local appended, refused, touched = 0, 0, {}
for i = 0, n - 1 do
  local key = KEYS[44 + i]
  if held[ids[i + 1]] then
    redis.call('XADD', key, 'MAXLEN', maxlen, '*', ARGV[6 + 3 * i], ARGV[7 + 3 * i])
    if not touched[key] then
      touched[key] = true
      redis.call('EXPIRE', key, ttl)
    end
    appended = appended + 1
  else
    refused = refused + 1
  end
end
return {appended, refused}
