--[[ preempt: give running requests of a batch back to the queue, as if never popped (a
continuous-batching consumer evicting LOW sequences for HIGH work: docs/scheduling.md).

Unlike requeue_expired, the delivery does not count: no attempt is used, so preemption
never dead-letters a request. A request keeps its arrival time (its place in its queue)
and is recomputed from the start by whichever consumer pops it next. Fenced by the batch
id: a batch whose lease lapsed (re-queued, maybe re-run) is refused.

KEYS[1..43] the queue's shared keys, in the order of scheduler_core.keys.SHARED_KEYS;
            this script uses:
KEYS[1]  {bg:q}:policy      hash  read: cost_buckets (the bucket sets and markers)
KEYS[2]  {bg:q}:pending:0   zset  HIGH
KEYS[3]  {bg:q}:pending:1   zset  NORMAL
KEYS[4]  {bg:q}:pending:2   zset  LOW
KEYS[5]  {bg:q}:jobs        hash  id -> "<meta>|<envelope>" (read only)
KEYS[6]  {bg:q}:costs       hash  id -> "<cost>:<bucket>:<prio>": a returned request's entry
KEYS[7]  {bg:q}:clock       string last arrival score issued (the queue's clock: queue_now)
KEYS[8]  {bg:q}:marker      zset  wake-up marker
KEYS[9]  {bg:q}:stats       hash  counters (preempted, preempted_steps); the queue's clock
KEYS[10] {bg:q}:inflight    zset  batch id -> lease deadline (µs)
KEYS[11] {bg:q}:owner       hash  id -> batch id
KEYS[12] {bg:q}:batches     hash  batch id -> "consumer|ids"
KEYS[20] {bg:q}:deadlines   zset  pending id -> deadline (µs): listed again
KEYS[24..28] {bg:q}:marker:<1..5> zset  wake-up markers of consumers dedicated to a cost bucket
KEYS[29..33] {bg:q}:bucket:<1..5> zset  the ids waiting in each cost bucket (score = arrival)
KEYS[35] {bg:q}:tenants     hash  per named tenant's counters (lua/_tenants.lua)
KEYS[37..39] {bg:q}:fair:<0..2> zset  fairness requests | cost (lua/_fair.lua): waiting
                                  requests by tenant, then arrival
KEYS[40..42] {bg:q}:vtc:<0..2> zset  the backlogged tenants of each level -> virtual counter
KEYS[43] {bg:q}:fair:who    hash  id -> tenant of each request in the fair sets

ARGV[1]  batch id (the fencing token returned by pop_batch)
ARGV[2]  n, number of request ids (1..the largest max_batch_size of the policy LIMITS)
ARGV[3..2+n] the request ids to give back
ARGV[3+n..2+2n] the decode steps each of them had run (0..10^12): wasted, counted in
         preempted_steps for those given back

Returns  {given_back, remaining}: requests returned to the queue (an id not, or no longer,
         in this batch is skipped); requests of the batch still open. The batch leaves
         the in-flight set when remaining reaches 0.
Errors   {-1}  stale batch: its lease expired and it was re-queued (or it never existed)
         {-3, field} malformed argument
Work is bounded by n plus the batch's size.
]]
-- @include _common.lua
-- @include _policy.lua
-- @include _tenants.lua
-- @include _fair.lua
-- @include _queue.lua

local policy = KEYS[1]
local pending_high = KEYS[2]
local pending_normal = KEYS[3]
local pending_low = KEYS[4]
local jobs = KEYS[5]
local costs = KEYS[6]
local clock = KEYS[7]
local marker = KEYS[8]
local stats = KEYS[9]
local inflight = KEYS[10]
local owner = KEYS[11]
local batches = KEYS[12]
local deadlines = KEYS[20]
local bucket_markers = {KEYS[24], KEYS[25], KEYS[26], KEYS[27], KEYS[28]}
local bucket_sets = {KEYS[29], KEYS[30], KEYS[31], KEYS[32], KEYS[33]}
local tenants = KEYS[35]
local fair_sets = {KEYS[37], KEYS[38], KEYS[39]}
local fair_counters = {KEYS[40], KEYS[41], KEYS[42]}
local fair_who = KEYS[43]

local batch_id = ARGV[1]
local _, most = policy_range('max_batch_size')
local n = int_arg(ARGV[2], 1, most)
if not n or #ARGV ~= 2 + 2 * n then return {-3, 'n'} end
local steps = {}
for i = 1, n do
  steps[i] = int_arg(ARGV[2 + n + i], 0, 1000000000000)
  if not steps[i] then return {-3, 'steps'} end
end
if not redis.call('ZSCORE', inflight, batch_id) then return {-1} end

local pending = {pending_high, pending_normal, pending_low}
local now = queue_now(clock, stats)
local bounds = stored_bounds(policy)
local fair = fair_open(policy, fair_sets, fair_counters, fair_who)
local given = 0
local wasted = 0
local tally = tenant_tally()
for i = 3, 2 + n do
  local id = ARGV[i]
  if redis.call('HGET', owner, id) == batch_id then
    local raw = redis.call('HGET', jobs, id)
    local m = parse_job(raw)
    local t = job_tenant(raw)
    if t then  -- tenants (lua/_tenants.lua): back from in flight to waiting
      tally.add_tenant(t, 'f', -1)
      tally.add_tenant(t, 'w', 1)
    end
    return_to_waiting(pending, costs, deadlines, bucket_sets, bounds, id, m, now, fair)
    redis.call('HDEL', owner, id)
    given = given + 1
    wasted = wasted + steps[i - 2]
  end
end
local remaining = 0
local members = batch_members(batches, batch_id)
if #members > 0 then
  for _, holder in ipairs(redis.call('HMGET', owner, unpack(members))) do
    if holder == batch_id then remaining = remaining + 1 end
  end
end
if remaining == 0 then release_batch(inflight, batches, batch_id) end
tally.flush(tenants)
if given > 0 then
  redis.call('HINCRBY', stats, 'preempted', given)
  if wasted > 0 then redis.call('HINCRBY', stats, 'preempted_steps', wasted) end
  wake_consumers(marker)
  wake_buckets(bucket_markers, bucket_count(bounds))
end
return {given, remaining}
