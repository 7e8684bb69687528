"""`batchgate consumer --batching continuous` (issue 36 §2), with real consumer processes
and the built-in generator: a short request joins a running long one and is answered
while the long one still runs; every result equals the request generated alone; tokens
stream as they come; a bad payload fails alone; a consumer SIGKILLed mid-generation has
its requests re-run elsewhere, each answered once with its solo output; a model that
cannot step is refused naming --batching."""

from __future__ import annotations

import subprocess
import time

import pytest
from helpers.failure_support import CountingProducer
from helpers.processes import BATCHGATE

from producer import Producer, RequestFailed, Restart

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from consumer.models.decoder import Generator, build_gpt2  # noqa: E402

MODEL = {"vocab": 512, "layers": 2, "dim": 64, "heads": 2, "positions": 512}
ARGS = [a for k, v in MODEL.items() for a in ("--model-arg", f"{k}={v}")]


@pytest.fixture(scope="module")
def solo():
    """The request's output generated alone, in process (static, one request a batch)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = Generator(build_gpt2(**MODEL), warmup_batches=(), max_new_tokens_cap=500)
    yield lambda payload: model([payload])[0]
    torch.set_num_threads(threads)


def continuous(start_consumer, url, queue, *args):
    return start_consumer(url, queue, "--model", "consumer.models:generator", *ARGS,
                          "--model-arg", "stream=true", "--model-arg",
                          "max_new_tokens_cap=500", "--batching", "continuous",
                          "--torch-threads", "1", "--strategy", "fifo", *args)


def test_a_short_request_joins_a_running_long_one_and_leaves_first(
        shared_redis, queue, start_consumer, solo):
    continuous(start_consumer, shared_redis.url, queue, "--max-batch-size", "4")
    long_payload = {"prompt": "a long one", "max_new_tokens": 480}
    shorts = [{"prompt": f"short {i}", "max_new_tokens": 4 + i} for i in range(3)]
    with Producer(shared_redis.url, queue) as p:
        long = p.submit(long_payload)
        parts = long.stream(timeout=60)
        first = next(parts)  # the long request is running
        handles = p.submit_many([*shorts, {"prompt": "x", "max_new_tokens": -3}])
        results = [h.result(timeout=60) for h in handles[:3]]
        # Answered while the long one still runs: the batch never waited for it.
        assert not long.done()
        with pytest.raises(RequestFailed, match="'max_new_tokens' must be an integer >= 1"):
            handles[3].result(timeout=60)
        streamed = [first, *parts]
        long_result = long.result(timeout=60)
        for h, r in zip(handles[:3], results, strict=True):
            assert [part["token"] for part in h.stream(timeout=5)] == r["tokens"]
    assert [part["token"] for part in streamed] == long_result["tokens"]
    assert long_result == solo(long_payload)
    assert results == [solo(s) for s in shorts]


def test_a_consumer_killed_mid_generation_has_each_request_rerun_and_answered_once(
        redis_server, queue, start_consumer, solo):
    url = redis_server.url
    args = ("--max-batch-size", "3", "--lease-ms", "1000")
    first = continuous(start_consumer, url, queue, *args)
    payloads = [{"prompt": f"request {i}", "max_new_tokens": 300 + 40 * i} for i in range(5)]
    with CountingProducer(url, queue) as p:
        handles = p.submit_many(payloads)
        events = handles[0].stream(timeout=60)
        seen = [next(events) for _ in range(3)]
        first.kill()  # SIGKILL, three tokens into request 0
        continuous(start_consumer, url, queue, *args)
        seen += list(events)
        results = [h.result(timeout=120) for h in handles]
        time.sleep(0.5)  # a second delivery would land now
        assert all(p.deliveries[h.id] == 1 for h in handles)
    assert results == [solo(x) for x in payloads]
    assert Restart(2) in seen
    rerun = seen[seen.index(Restart(2)) + 1:]
    assert [part["token"] for part in rerun] == results[0]["tokens"]


def test_a_model_that_cannot_step_is_refused_naming_the_flag(shared_redis, queue):
    out = subprocess.run([BATCHGATE, "consumer", "--redis-url", shared_redis.url, "--queue",
                          queue, "--model", "consumer.models:noop", "--batching",
                          "continuous"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "batching" in out.stderr and "step-wise model" in out.stderr
    bad = subprocess.run([BATCHGATE, "consumer", "--batching", "sometimes"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--batching" in bad.stderr
