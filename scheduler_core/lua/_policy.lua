-- The queue policy's rules, inlined where a script says "-- @include _policy.lua" (after
-- _common.lua).

-- STRATEGIES, DELAY_MODES, LIMITS (each integer field's {min, max}) and
-- policy_range(field) (min, max as code) are rendered here by scheduler_core/scripts.py from scheduler_core/policy.py
-- when the scripts load: that module is their one source.
-- @render policy

-- A stored or given policy field as a number if within its limits, else nil.
local function policy_int(field, value)
  local low, high = policy_range(field)
  return low and int_arg(value, low, high)
end
