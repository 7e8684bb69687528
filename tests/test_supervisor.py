"""`batchgate consumer --replicas N / --devices`: one supervised consumer per replica or
device; a child that fails is replaced, one that stops cleanly is not; SIGTERM stops them
all and exits 0."""

from __future__ import annotations

import os
import signal
import sys
import time
import types

from click.testing import CliRunner
from helpers.support import alive, started, wait_for

from batchgate.cli import main
from consumer.cli import consumer_command
from consumer.supervisor import Supervisor, child_commands, parse_devices
from producer import Priority, Producer
from scheduler_core.compat import usable_cores
from scheduler_core.keys import QueueKeys
from scheduler_core.ops.stats import queue_stats


def test_replicas_restart_a_killed_child_and_stop_on_sigterm(shared_redis, queue,
                                                             start_consumer):
    sup = start_consumer(shared_redis.url, queue, "--model", "consumer.models:noop",
                         "--replicas", "2", "--stop-timeout", "10", ready=False)
    wait_for(lambda: sup.output().count("ready on queue") >= 2, timeout=60,
             what="two ready consumers")
    client = shared_redis.client()
    wait_for(lambda: queue_stats(client, queue).consumers_alive == 2, what="2 alive")
    first = dict(started(sup.output()))
    assert sorted(first) == [0, 1]

    os.kill(first[0], signal.SIGKILL)
    wait_for(lambda: len(started(sup.output())) >= 3, timeout=30, what="a replacement")
    assert "exited with status -9; restarting in" in sup.output()
    replacement = started(sup.output())[-1]
    assert replacement[0] == 0 and replacement[1] != first[0]
    wait_for(lambda: sup.output().count("ready on queue") >= 3, timeout=60,
             what="the replacement to be ready")
    with Producer(shared_redis.url, queue) as producer:
        handles = producer.submit_many([{"i": i} for i in range(40)], priority=Priority.HIGH)
        assert [h.result(timeout=15) for h in handles] == [{"i": i} for i in range(40)]

    assert sup.stop(timeout=30) == 0
    children = [first[1], replacement[1]]
    wait_for(lambda: not any(alive(pid) for pid in children), timeout=10,
             what="children to exit")
    assert sup.output().count("stopped after") == 2


def test_usage_error_in_children_stops_the_supervisor(shared_redis, queue, start_consumer):
    sup = start_consumer(shared_redis.url, queue, "--model", "no_such_module:model",
                         "--replicas", "2", ready=False)
    assert sup.proc.wait(timeout=60) == 2
    assert "usage error" in sup.output()


def test_child_command_lines():
    ctx = consumer_command.make_context("consumer", [
        "--queue", "q1", "--model", "consumer.models:tiny_text", "--model-arg", "seed=1",
        "--model-arg", "classes=3", "--devices", "cuda:0,cuda:1", "--replicas", "2",
        "--name", "gpu", "--metrics-port", "9100", "--max-batch-size", "16"])
    commands = child_commands(ctx)
    assert [label for label, _ in commands] == ["0 (cuda:0)", "1 (cuda:0)", "2 (cuda:1)",
                                                "3 (cuda:1)"]
    for slot, (_, argv) in enumerate(commands):
        tail = argv[argv.index("consumer") + 1:]
        assert "--replicas" not in tail and "--devices" not in tail
        assert tail.count("--model-arg") == 2 and tail[tail.index("--queue") + 1] == "q1"
        assert tail[tail.index("--max-batch-size") + 1] == "16"
        assert tail[tail.index("--device") + 1] == ("cuda:0" if slot < 2 else "cuda:1")
        assert tail[tail.index("--name") + 1] == f"gpu-{slot}"
        assert tail[tail.index("--metrics-port") + 1] == str(9100 + slot)


def test_backoff_grows_and_is_capped():
    sup = Supervisor([], backoff_base_s=0.5, backoff_cap_s=4.0)
    assert [sup.backoff_s(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 4.0, 4.0]


def test_devices_all_enumerates_cuda_devices(monkeypatch):
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(device_count=lambda: 2))
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert parse_devices("all") == ["cuda:0", "cuda:1"]
    assert parse_devices(" cuda:1, cpu ") == ["cuda:1", "cpu"]
    fake.cuda.device_count = lambda: 0
    result = CliRunner().invoke(main, ["consumer", "--devices", "all"])
    assert result.exit_code == 2
    assert "no CUDA device" in result.output


def test_clean_stops_are_not_restarted_and_a_dead_childs_heartbeat_goes_at_once(
        shared_redis, queue, start_consumer):
    """Restart=on-failure, as systemd: a child killed (SIGKILL) is replaced; one that
    stops cleanly (SIGTERM: it finishes its batch and exits 0) is not; once none is left
    the supervisor exits 0. A dead child's heartbeat is removed when the supervisor sees it
    die, not CONSUMER_ALIVE_S later."""
    sup = start_consumer(shared_redis.url, queue, "--model", "consumer.models:noop",
                         "--replicas", "2", "--name", "sv", ready=False)
    wait_for(lambda: sup.output().count("ready on queue") >= 2, timeout=60,
             what="two ready consumers")
    client = shared_redis.client()
    consumers = QueueKeys(queue).consumers
    wait_for(lambda: client.zcard(consumers) == 2, what="two heartbeats")
    first = dict(started(sup.output()))

    os.kill(first[0], signal.SIGKILL)
    wait_for(lambda: "exited with status -9" in sup.output(), what="the death noticed")
    assert client.zscore(consumers, "sv-0") is None  # gone before the restart, not aged out
    assert queue_stats(client, queue).consumers_alive == 1
    wait_for(lambda: len(started(sup.output())) == 3, timeout=30, what="a replacement")

    os.kill(first[1], signal.SIGTERM)
    wait_for(lambda: "stopped cleanly (status 0); not restarting it" in sup.output(),
             what="the clean stop noticed")
    time.sleep(4 * 0.5)  # four first backoffs: a restart would have happened by now
    assert [slot for slot, _ in started(sup.output())] == [0, 1, 0]
    assert client.zscore(consumers, "sv-1") is None

    replacement = started(sup.output())[-1][1]
    wait_for(lambda: sup.output().count("ready on queue") >= 3, timeout=60,
             what="the replacement to be ready")
    os.kill(replacement, signal.SIGTERM)
    assert sup.proc.wait(timeout=30) == 0  # every child stopped cleanly: it is done
    assert "every consumer stopped cleanly" in sup.output()
    assert queue_stats(client, queue).consumers_alive == 0


def test_children_get_a_share_of_the_cores_and_no_supervisor_variables(queue, monkeypatch):
    monkeypatch.setenv("BATCHGATE_REPLICAS", "2")  # the children must not read it
    ctx = consumer_command.make_context("consumer", ["--queue", queue])
    commands = child_commands(ctx)
    assert len(commands) == 2
    share = str(max(1, usable_cores() // 2))
    for _, argv in commands:
        assert argv[argv.index("--torch-threads") + 1] == share
    assert "BATCHGATE_REPLICAS" not in Supervisor(commands).env
    ctx = consumer_command.make_context("consumer", ["--replicas", "3", "--torch-threads", "5"])
    assert {argv[argv.index("--torch-threads") + 1] for _, argv in child_commands(ctx)} == {"5"}
