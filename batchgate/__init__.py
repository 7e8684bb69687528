"""The `batchgate` command and the tools over both sides: demo, benchmark, embedded Redis."""

from scheduler_core.lifetime import die_with_marked_parent

# A `gateway --workers N` worker (multiprocessing's spawn) imports this first, by running
# the parent's `batchgate` main module: tie it to the gateway before its slower imports
# (producer.gateway.app_from_env does it again). Nothing in any other process.
die_with_marked_parent()
