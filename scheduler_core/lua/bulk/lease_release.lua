--[[ bulk/lease_release: give up a bulk job's lease if this run still holds it.

Not a queue script: a bulk job's lease is no queue's key (producer/bulk/state.py).

KEYS[1]  batchgate:bulk:<job>:lease   string  token of the run writing the job's output

ARGV[1]  this run's token

Returns  1 released; 0 not held by this run (lapsed, or another run's): left as it is
Errors   none
]]

local lease = KEYS[1]

local token = ARGV[1]
if redis.call('GET', lease) == token then
  return redis.call('DEL', lease)
else
  return 0
end
