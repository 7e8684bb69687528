--[[ bulk/lease_renew: extend a bulk job's lease if this run still holds it.

Not a queue script: a bulk job's lease is no queue's key (producer/bulk/state.py).

KEYS[1]  batchgate:bulk:<job>:lease   string  token of the run writing the job's output

ARGV[1]  this run's token
ARGV[2]  the lease's new time to live, ms

Returns  1 renewed; 0 the lease lapsed or another run holds it (this run must stop)
Errors   none
]]

local lease = KEYS[1]

local token, ttl_ms = ARGV[1], ARGV[2]
if redis.call('GET', lease) == token then
  return redis.call('PEXPIRE', lease, ttl_ms)
else
  return 0
end
