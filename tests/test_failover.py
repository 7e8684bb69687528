"""Failover with nothing lost (docs/guarantees.md "Failover"): the primary serving the
queue's slot is SIGKILLed mid-run, a replica is promoted (cluster failover or Sentinel),
clients reconnect on their own, and with wait_replicas=1 (producer) and --wait-replicas 1
(consumers) every accepted request is answered. The run is bench.failover's,
with fewer requests."""

from __future__ import annotations

import shutil

import pytest

from bench.failover import run

pytestmark = pytest.mark.skipif(not shutil.which("redis-server") or not
                                shutil.which("redis-cli"), reason="needs redis-server and "
                                "redis-cli (apt-get install redis-server)")


@pytest.mark.parametrize("mode", ["cluster", "sentinel"])
def test_nothing_accepted_is_lost_across_a_failover_with_wait_replicas(mode) -> None:
    figures = run(mode, requests=1000, rate=500, wait_replicas=1, drain_s=60)
    print(f"\n{figures}")
    assert figures["accepted"] == 1000
    assert figures["lost"] == 0 and figures["answered"] == 1000
    assert figures["unavailable_s"] > 0  # the kill did interrupt the run
