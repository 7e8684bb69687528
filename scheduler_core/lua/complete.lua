--[[ complete: record results of (part of) a batch, fenced by the batch id.

KEYS[1..43] the queue's shared keys, in the order of scheduler_core.keys.SHARED_KEYS;
            this script uses:
KEYS[1]  {bg:q}:policy        hash   read when a named tenant's request leaves in flight:
                                     fairness, tenant_quotas, cost_buckets
KEYS[8]  {bg:q}:marker        zset   woken when a tenant under max_in_flight may run more
KEYS[5]  {bg:q}:jobs          hash   id -> "<meta>|<envelope>"
KEYS[34] {bg:q}:retry        zset   id -> when it may run again (µs), for 'retry'
KEYS[7]  {bg:q}:clock         string last arrival score issued (the queue's clock: queue_now)
KEYS[9]  {bg:q}:stats         hash   counters; the queue's clock
KEYS[10] {bg:q}:inflight      zset   batch id -> lease deadline
KEYS[11] {bg:q}:owner         hash   id -> batch id
KEYS[12] {bg:q}:batches       hash   batch id -> "consumer|ids"
KEYS[15] {bg:q}:dead          zset   dead-lettered id -> time
KEYS[16] {bg:q}:dead:reason   hash   dead-lettered id -> error envelope
KEYS[18] {bg:q}:samples:e2e   list   recent enqueue-to-result times (µs)
KEYS[19] {bg:q}:samples:model list   recent batches as "size:model_us"
KEYS[24..28] {bg:q}:marker:<1..5> zset  woken with the marker
KEYS[35] {bg:q}:tenants     hash  per named tenant's counters (lua/_tenants.lua)
KEYS[44+2i] {bg:q}:result:<id_i>         result of request i (i = 0..n-1), written only if
                                         its request asked for it (keep); for a 'retry'
                                         {bg:q}:attempts:<id_i>, its failed runs (list)
KEYS[45+2i] {bg:q}:inbox:<producer_i>    its producer's inbox (any key if it has none)

ARGV[1]  batch id (the fencing token returned by pop_batch)
ARGV[2]  result TTL, seconds
ARGV[3]  n, number of results (1..the largest max_batch_size of the policy LIMITS)
ARGV[4+3i..6+3i] for result i: id, outcome ('ok' | 'err' | 'dead' | 'expired' | 'retry'),
         result envelope; 'expired' (deadline passed, not run) counts as expired, not
         failed; for 'retry' "<backoff ms (0..86400000)>|<this run's error>" instead of
         an envelope: the error is pushed onto KEYS[44+2i]
ARGV[4+3n] optional: the batch's model run as "size:model_us", pushed to KEYS[19]

Returns  {accepted, refused, remaining}: results written; results refused because the
         request is not (or no longer) in this batch; requests of the batch still open.
         The batch leaves the in-flight set when remaining reaches 0.
Errors   {-1}  stale batch: its lease expired and it was re-queued (or it never existed);
               nothing written, the late result is discarded
         {-3, field} malformed argument

'dead' keeps the request in jobs, its attempts counting this delivery, and lists it in
the dead-letter set. 'retry' answers nothing: it keeps the request in jobs, its attempts
counting this delivery, and lists it in the retry set until now + backoff, or until its
deadline if that is earlier (pop_batch moves it back to its level then); counted as
`retried`. The result goes to the producer's inbox (if it has one); it is stored
by id as well (result:<id>, Producer.fetch) only for a request enqueued with keep = 1.
Work is bounded by n plus the batch's size.
]]
-- @include _common.lua
-- @include _policy.lua
-- @include _tenants.lua
-- @include _fair.lua
-- @include _queue.lua

local policy = KEYS[1]
local marker = KEYS[8]
local jobs = KEYS[5]
local retry = KEYS[34]
local clock = KEYS[7]
local stats = KEYS[9]
local inflight = KEYS[10]
local owner = KEYS[11]
local batches = KEYS[12]
local dead = KEYS[15]
local dead_reason = KEYS[16]
local e2e_samples = KEYS[18]
local model_samples = KEYS[19]
local bucket_markers = {KEYS[24], KEYS[25], KEYS[26], KEYS[27], KEYS[28]}
local tenants = KEYS[35]
-- KEYS[44 + 2i], KEYS[45 + 2i]: result:<id> and inbox:<producer> of result i

local batch_id = ARGV[1]
local _, most_results = policy_range('max_batch_size')  -- a batch's results fit one call
local ttl, n = int_arg(ARGV[2], 1, 315360000), int_arg(ARGV[3], 1, most_results)
if not ttl then return {-3, 'result_ttl_s'} end
if not n or (#ARGV ~= 3 + 3 * n and #ARGV ~= 4 + 3 * n) or #KEYS ~= 43 + 2 * n then
  return {-3, 'n'}
end
local model_sample = ARGV[4 + 3 * n]
if model_sample and not string.match(model_sample, '^%d+:%d+$') then
  return {-3, 'model_sample'}
end
local outcomes = {ok = true, err = true, dead = true, expired = true, retry = true}
for i = 0, n - 1 do
  if not outcomes[ARGV[5 + 3 * i]] then return {-3, 'outcome'} end
  if ARGV[5 + 3 * i] == 'retry'
     and not int_arg(string.match(ARGV[6 + 3 * i], '^(%d+)|'), 0, 86400000) then
    return {-3, 'backoff_ms'}
  end
end
if not redis.call('ZSCORE', inflight, batch_id) then return {-1} end

local now = queue_now(clock, stats)
local accepted, refused, failed, expired, retried = 0, 0, 0, 0, 0
local ids = {}
for i = 0, n - 1 do ids[i + 1] = ARGV[4 + 3 * i] end
-- One variadic call per key rather than one per request: the script's cost is mostly
-- the number of redis.call()s.
local owners = redis.call('HMGET', owner, unpack(ids))
local raw = redis.call('HMGET', jobs, unpack(ids))
local done, gone, e2e, inboxes, inbox_order, seen = {}, {}, {}, {}, {}, {}
local counted = {}  -- dead ones: their jobs value with this delivery counted
local answered = {}  -- the indexes (1-based) of the results accepted
for i = 0, n - 1 do
  local id, outcome, envelope = ids[i + 1], ARGV[5 + 3 * i], ARGV[6 + 3 * i]
  if owners[i + 1] ~= batch_id or seen[id] then  -- a repeated id is delivered once
    refused = refused + 1
  elseif outcome == 'retry' then  -- nothing delivered: it runs again
    seen[id] = true
    local m = parse_job(raw[i + 1])
    local backoff_ms, error = string.match(envelope, '^(%d+)|(.*)$')
    local due = now + tonumber(backoff_ms) * 1000
    -- Kept while it may still be read: until the result would expire after the wait.
    redis.call('RPUSH', KEYS[44 + 2 * i], error)
    redis.call('EXPIRE', KEYS[44 + 2 * i], ttl + math.ceil(tonumber(backoff_ms) / 1000))
    if m then
      if m.deadline > 0 then due = math.min(due, m.deadline) end
      m.attempts = m.attempts + 1
      counted[#counted + 1] = id
      counted[#counted + 1] = format_job(m)
    end
    redis.call('ZADD', retry, int(due), id)
    done[#done + 1] = id
    answered[#answered + 1] = i + 1  -- it leaves in flight (its tenant's count too)
    retried = retried + 1
    accepted = accepted + 1
  else
    seen[id] = true
    local arrival, keep, producer = job_route(raw[i + 1])
    -- Without readable meta (written by hand) the result is stored: no inbox to take it.
    if not arrival or keep then store_result(KEYS[44 + 2 * i], envelope, ttl) end
    if arrival and producer ~= '' then
      local inbox = KEYS[45 + 2 * i]
      if not inboxes[inbox] then
        inboxes[inbox] = {}
        inbox_order[#inbox_order + 1] = inbox
      end
      table.insert(inboxes[inbox], envelope)
    end
    if arrival then e2e[#e2e + 1] = int(now - arrival) end
    done[#done + 1] = id
    answered[#answered + 1] = i + 1
    if outcome == 'dead' then
      add_dead_letter(dead, dead_reason, id, now, envelope)
      local m = parse_job(raw[i + 1])
      if m then
        m.attempts = m.attempts + 1
        counted[#counted + 1] = id
        counted[#counted + 1] = format_job(m)
      end
    else
      gone[#gone + 1] = id
    end
    if outcome == 'expired' then
      expired = expired + 1
    elseif outcome ~= 'ok' then
      failed = failed + 1
    end
    accepted = accepted + 1
  end
end
-- Tenants (lua/_tenants.lua): the answered requests leave in flight; those that ran (ok,
-- err) count as served, in requests and in cost.
if #answered > 0 then
  local tally, freed = tenant_tally(), false
  for _, i in ipairs(answered) do
    local t, outcome = job_tenant(raw[i]), ARGV[2 + 3 * i]
    if t then
      freed = true
      tally.add_tenant(t, 'f', -1)
      if outcome == 'ok' or outcome == 'err' then
        tally.add_tenant(t, 's', 1)
        tally.add_tenant(t, 'sc', select(3, pop_fields(raw[i])) or 1)
      end
    end
  end
  tally.flush(tenants)
  -- Under fairness, a pop passes over a tenant at its max_in_flight (lua/_fair.lua): one
  -- may now take its requests.
  local p = freed and redis.call('HMGET', policy, 'fairness', 'tenant_quotas')
  if p and (p[1] == 'requests' or p[1] == 'cost') and p[2]
     and string.find(p[2], 'max_in_flight=', 1, true) then
    wake_consumers(marker)
    wake_buckets(bucket_markers, bucket_count(stored_bounds(policy)))
  end
end
for _, inbox in ipairs(inbox_order) do  -- results keep their order within each inbox
  deliver_results(inbox, ttl, unpack(inboxes[inbox]))
end
if #done > 0 then redis.call('HDEL', owner, unpack(done)) end
if #gone > 0 then redis.call('HDEL', jobs, unpack(gone)) end
if #counted > 0 then call_in_chunks('HSET', jobs, counted) end  -- 2 values per request

local remaining = 0
local listed = redis.call('HGET', batches, batch_id)
-- The usual case, every request of the batch answered in this call, needs no owner
-- lookup: the accepted ids are distinct members of the batch.
if select(2, split_members(listed, true)) > accepted then
  for _, holder in ipairs(redis.call('HMGET', owner, unpack((split_members(listed))))) do
    if holder == batch_id then remaining = remaining + 1 end
  end
end
if remaining == 0 then release_batch(inflight, batches, batch_id) end
if accepted > 0 then
  redis.call('HINCRBY', stats, 'processed', accepted - failed - expired - retried)
  if retried > 0 then redis.call('HINCRBY', stats, 'retried', retried) end
  redis.call('HINCRBY', stats, 'failed', failed)
  if expired > 0 then redis.call('HINCRBY', stats, 'expired', expired) end
  -- Recent service rate (enqueue's retry-after hint): completions counted over windows of
  -- at least 1 s; rate_mrps = the last window's rate in milli-requests per second. A
  -- window longer than 10 s spanned an idle gap and is not published.
  local w = redis.call('HMGET', stats, 'rate_since_us', 'rate_count')
  local since, count = tonumber(w[1]), (tonumber(w[2]) or 0) + accepted
  if not since or now - since >= 1000000 then
    if since and now - since <= 10000000 then
      redis.call('HSET', stats, 'rate_mrps', int(count * 1e9 / (now - since)))
    end
    redis.call('HSET', stats, 'rate_since_us', int(now), 'rate_count', 0)
  else
    redis.call('HSET', stats, 'rate_count', count)
  end
end
if #e2e > 0 then push_samples(e2e_samples, unpack(e2e)) end
if model_sample then push_samples(model_samples, model_sample) end
return {accepted, refused, remaining}
