"""Network faults between consumer hosts and Redis (docs/guarantees.md "Network
partitions"): a consumer runs in a network namespace of its own, joined to Redis by a
veth pair, and its link is cut for 5 s while it holds a batch. Its lease expires, the
batch is re-run by a consumer on another host, its late completion is refused (the batch
id is a fencing token), and the result is delivered once. A lossy link (packets dropped
both ways) slows the consumer host down and loses nothing. Needs root (`ip netns`); skips
with the reason elsewhere."""

from __future__ import annotations

import collections
import shutil
import time

import pytest
from helpers.processes import ConsumerProcess, RedisServer
from helpers.support import RecordingModel, configure, wait_for

from bench.netns import ConsumerHost, unavailable_reason
from producer import Producer
from scheduler_core.ops.stats import queue_stats

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no network namespaces: {REASON}")

PARTITION_S = 5.0
LEASE_MS = 1000
LOSS_PCT = 5


def test_a_partitioned_consumer_loses_its_batch_and_its_late_completion_is_refused(
        queue, tmp_path) -> None:
    model = RecordingModel(tmp_path)
    deliveries: collections.Counter[str] = collections.Counter()
    started: list[ConsumerProcess] = []
    with ConsumerHost() as host:
        server = RedisServer("--bind", "127.0.0.1", host.host_ip, "--protected-mode", "no")
        try:
            configure(server.url, queue, strategy="fifo")
            remote = ConsumerProcess(f"redis://{host.host_ip}:{server.port}/0", queue,
                                     *model.args(stamp=True), "--lease-ms", str(LEASE_MS),
                                     cwd=str(tmp_path), wrap=host.argv([]))
            started.append(remote)
            remote.wait_ready()
            with Producer(server.url, queue,
                          on_result=lambda r: deliveries.update([r.id])) as p:
                handle = p.submit({"sleep_ms": 2000}, store_result=True)
                wait_for(lambda: model.batches(remote.proc.pid), what="the remote batch")
                host.partition()
                cut_at = time.monotonic()
                try:
                    local = ConsumerProcess(server.url, queue, *model.args(stamp=True),
                                            "--lease-ms", str(LEASE_MS), cwd=str(tmp_path))
                    started.append(local)
                    local.wait_ready()
                    result = handle.result(timeout=30)
                    rerun_s = time.monotonic() - cut_at
                    assert result == {"by": local.proc.pid, "payload": {"sleep_ms": 2000}}
                    time.sleep(max(0.0, PARTITION_S - (time.monotonic() - cut_at)))
                finally:
                    host.heal()
                wait_for(lambda: "results were refused" in remote.output(), timeout=40,
                         what="the remote consumer's late completion to be refused")
                time.sleep(1.5)  # a second delivery, if there were one, arrives by now
                assert p.fetch(handle.id).value["by"] == local.proc.pid
            print(f"\nre-run elsewhere {rerun_s:.2f}s after the cut (lease {LEASE_MS} ms)")
            assert rerun_s >= LEASE_MS / 1000 * 2 / 3 - 0.05
            assert deliveries == {handle.id: 1}  # delivered once
            assert [b["payloads"] for b in model.batches()] == [[{"sleep_ms": 2000}]] * 2
            stats = queue_stats(server.client(), queue)
            assert (stats.processed, stats.requeued, stats.in_flight_batches) == (1, 1, 0)
        finally:
            for proc in started:
                proc.close()
            server.close()


@pytest.mark.skipif(shutil.which("iptables") is None, reason="no iptables to lose packets")
def test_a_lossy_link_loses_no_request_and_answers_each_once(queue, tmp_path) -> None:
    model = RecordingModel(tmp_path)
    deliveries: collections.Counter[str] = collections.Counter()
    with ConsumerHost() as host:
        server = RedisServer("--bind", "127.0.0.1", host.host_ip, "--protected-mode", "no")
        remote = None
        try:
            configure(server.url, queue, strategy="dynamic", max_batch_size=16,
                      max_queue_delay_ms=5)
            remote = ConsumerProcess(f"redis://{host.host_ip}:{server.port}/0", queue,
                                     *model.args(stamp=True), "--lease-ms", "5000",
                                     cwd=str(tmp_path), wrap=host.argv([]))
            remote.wait_ready()
            host.drop(LOSS_PCT)
            with Producer(server.url, queue,
                          on_result=lambda r: deliveries.update([r.id])) as p:
                handles = p.submit_many([{"i": i} for i in range(300)])
                results = [h.result(timeout=60) for h in handles]
                wait_for(lambda: len(deliveries) == 300, what="every result delivered")
            assert results == [{"by": remote.proc.pid, "payload": {"i": i}}
                               for i in range(300)]
            assert set(deliveries.values()) == {1}
            assert queue_stats(server.client(), queue).processed == 300
        finally:
            if remote is not None:
                remote.close()
            server.close()
