"""The `batchgate` command and the tools over both sides: demo, benchmark, embedded Redis."""
