"""Operator tooling over the protocol: a queue's state read back (reading, stats,
snapshot), the simulator and the planner, and the click options every command shares.

It builds on scheduler_core and nothing in scheduler_core outside this package imports
it (tests/test_layers.py): a producer or consumer at run time needs none of it.
"""
