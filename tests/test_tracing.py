"""OpenTelemetry (the `otel` extra): the producer's trace context travels in the envelope,
and the consumer's spans (queue wait, batch, model) connect to each request's trace."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from helpers.support import wait_for

from consumer import Consumer
from consumer.models import synthetic
from producer import AsyncProducer, Priority, Producer
from scheduler_core.errors import InvalidRequest
from scheduler_core.keys import QueueKeys
from scheduler_core.wire import decode_request, decode_request_traced, encode_request, split_job

sdk_trace = pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

ROOT = Path(__file__).resolve().parent.parent
PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def in_memory() -> tuple[Any, InMemorySpanExporter]:
    """A tracer of its own (not the global provider) and the spans it recorded."""
    spans = InMemorySpanExporter()
    provider = sdk_trace.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    return provider.get_tracer("test"), spans


def traceparent(span: Any) -> str:
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def test_envelope_carries_a_trace_only_when_given():
    assert encode_request({"a": 1}) == b'{"v":1,"payload":{"a":1}}'
    traced = encode_request({"a": 1}, trace={"traceparent": PARENT})
    assert orjson.loads(traced) == {"v": 1, "payload": {"a": 1},
                                    "trace": {"traceparent": PARENT}}
    assert decode_request(traced) == {"a": 1}
    assert decode_request_traced(traced) == ({"a": 1}, {"traceparent": PARENT})
    assert decode_request_traced(encode_request([1])) == ([1], None)
    # a malformed trace never fails the request at the consumer ...
    odd = b'{"v":1,"payload":2,"trace":{"traceparent":7}}'
    assert decode_request_traced(odd) == (2, None)
    # ... and is refused, naming the field, at the producer
    with pytest.raises(InvalidRequest, match="trace.baggage"):
        encode_request(1, trace={"traceparent": PARENT, "baggage": "x"})
    with pytest.raises(InvalidRequest, match="trace.tracestate"):
        encode_request(1, trace={"traceparent": PARENT, "tracestate": "k=v," * 200})


def test_producer_puts_the_active_span_in_the_envelope(shared_redis, queue):
    tracer, _ = in_memory()
    with Producer(shared_redis.url, queue) as producer:
        plain = producer.submit({"i": 0})
        with tracer.start_as_current_span("web request") as span:
            traced = producer.submit_many([{"i": 1}, {"i": 2}], priority=Priority.HIGH)
        jobs = {k: split_job(v)[1] for k, v in redis.Redis.from_url(
            shared_redis.url).hgetall(QueueKeys(queue).jobs).items()}
        assert jobs[plain.id.encode()] == encode_request({"i": 0})  # nothing added
        for handle in traced:
            envelope = orjson.loads(jobs[handle.id.encode()])
            assert envelope["trace"] == {"traceparent": traceparent(span)}

    async def submit_async() -> tuple[str, str]:
        async with AsyncProducer(shared_redis.url, queue) as producer:
            with tracer.start_as_current_span("async request") as span:
                handle = await producer.submit({"i": 3})
            return handle.id, traceparent(span)
    request_id, expected = asyncio.run(submit_async())
    envelope = orjson.loads(split_job(redis.Redis.from_url(shared_redis.url).hget(
        QueueKeys(queue).jobs, request_id))[1])
    assert envelope["trace"] == {"traceparent": expected}


def test_consumer_spans_in_process(shared_redis, queue):
    """The consumer's batch handling in this process, its spans in an in-memory exporter."""
    tracer, spans = in_memory()
    producer_tracer, _ = in_memory()
    with Producer(shared_redis.url, queue) as producer:
        with producer_tracer.start_as_current_span("a") as span_a:
            first = producer.submit({"i": 1})
        with producer_tracer.start_as_current_span("b") as span_b:
            second = producer.submit({"i": 2})
        untraced = producer.submit({"i": 3})
        time.sleep(0.2)  # every request waits at least this long: no consumer yet
        with Consumer(synthetic(base_ms=1, per_item_ms=0), redis_url=shared_redis.url,
                      queue=queue, tracer=tracer):
            assert [h.result(timeout=30) for h in (first, second, untraced)]

    finished = {s.name: [] for s in spans.get_finished_spans()}
    for s in spans.get_finished_spans():
        finished[s.name].append(s)
    (batch,) = finished["batchgate batch"]  # all three were waiting at the first pop
    assert batch.parent is None
    assert batch.attributes["batchgate.batch.size"] == 3
    assert batch.attributes["batchgate.strategy"] == "priority"
    assert batch.attributes["batchgate.queue"] == queue
    assert isinstance(batch.attributes["batchgate.batch.id"], str)
    linked = {link.context.span_id: link.attributes["batchgate.request.id"]
              for link in batch.links}
    assert linked == {span_a.get_span_context().span_id: first.id,
                      span_b.get_span_context().span_id: second.id}
    waits = {w.attributes["batchgate.request.id"]: w for w in finished["batchgate queue wait"]}
    assert set(waits) == {first.id, second.id}
    for handle, span in ((first, span_a), (second, span_b)):
        wait = waits[handle.id]
        assert wait.context.trace_id == span.get_span_context().trace_id
        assert wait.parent.span_id == span.get_span_context().span_id
        assert wait.end_time - wait.start_time >= 0.2e9
    (model,) = finished["batchgate model"]
    assert model.parent.span_id == batch.context.span_id
    assert model.attributes["batchgate.batch.size"] == 3
    assert batch.start_time <= model.start_time <= model.end_time <= batch.end_time


def test_continuous_consumer_spans(shared_redis, queue):
    """--batching continuous: a popped batch's spans are a static batch's; its model span
    runs from its members' first step to their last (steps shared with the running
    batch)."""
    from helpers.step_models import Counter

    tracer, spans = in_memory()
    producer_tracer, _ = in_memory()
    with Producer(shared_redis.url, queue) as producer:
        with producer_tracer.start_as_current_span("a") as span_a:
            first = producer.submit({"i": 1, "n": 3})
        second = producer.submit({"i": 2, "n": 5})
        with Consumer(Counter(sleep_ms=5), redis_url=shared_redis.url, queue=queue,
                      batching="continuous", strategy="fifo", max_batch_size=4,
                      tracer=tracer):
            assert first.result(timeout=30) == {"i": 1, "steps": 3}
            assert second.result(timeout=30) == {"i": 2, "steps": 5}

    finished = {s.name: [] for s in spans.get_finished_spans()}
    for s in spans.get_finished_spans():
        finished[s.name].append(s)
    (batch,) = finished["batchgate batch"]  # both popped at once
    assert batch.attributes["batchgate.batch.size"] == 2
    assert {link.context.span_id for link in batch.links} == \
        {span_a.get_span_context().span_id}
    (wait,) = finished["batchgate queue wait"]
    assert wait.parent.span_id == span_a.get_span_context().span_id
    (model,) = finished["batchgate model"]
    assert model.parent.span_id == batch.context.span_id
    assert model.attributes["batchgate.batch.size"] == 2
    assert model.attributes["batchgate.failed"] == 0
    assert model.end_time - model.start_time >= 5 * 5e6  # five steps of 5 ms
    assert batch.start_time <= model.start_time <= model.end_time <= batch.end_time


def console_spans(output: str) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in output.splitlines() if line.startswith('{"name"')]


def iso_ns(text: str) -> int:
    return int(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1e9)


def test_consumer_process_prints_spans_linked_to_each_request(shared_redis, queue,
                                                               start_consumer):
    """A real `batchgate consumer --otel-exporter console`: one JSON line per span."""
    tracer, _ = in_memory()
    with Producer(shared_redis.url, queue) as producer:
        with tracer.start_as_current_span("a") as span_a:
            first = producer.submit({"i": 1})
        with tracer.start_as_current_span("b") as span_b:
            second = producer.submit({"fail": True})
        consumer = start_consumer(shared_redis.url, queue, "--model",
                                  "consumer.models:synthetic", "--model-arg", "base_ms=1",
                                  "--model-arg", "per_item_ms=0", "--otel-exporter", "console")
        assert first.result(timeout=30) is not None
        with pytest.raises(Exception, match="synthetic failure"):
            second.result(timeout=30)

    def printed() -> list[dict[str, Any]]:
        spans = console_spans(consumer.output())
        return spans if any(s["name"] == "batchgate batch" for s in spans) else []
    spans = wait_for(printed, 15, "the batch span on stdout")
    by_name: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        by_name.setdefault(span["name"], []).append(span)
    (batch,) = by_name["batchgate batch"]
    assert batch["parent_id"] is None and batch["kind"] == "SpanKind.CONSUMER"
    assert batch["attributes"]["batchgate.batch.size"] == 2
    assert batch["attributes"]["batchgate.strategy"] == "priority"
    assert batch["resource"]["attributes"]["service.name"] == "batchgate-consumer"
    ids = {f"0x{s.get_span_context().trace_id:032x}" for s in (span_a, span_b)}
    assert {link["context"]["trace_id"] for link in batch["links"]} == ids
    assert {w["context"]["trace_id"] for w in by_name["batchgate queue wait"]} == ids
    parents = {f"0x{s.get_span_context().span_id:016x}" for s in (span_a, span_b)}
    assert {w["parent_id"] for w in by_name["batchgate queue wait"]} == parents
    (model,) = by_name["batchgate model"]
    assert model["parent_id"] == batch["context"]["span_id"]
    assert model["context"]["trace_id"] == batch["context"]["trace_id"]
    assert model["attributes"]["batchgate.failed"] == 1
    assert model["status"]["status_code"] == "ERROR"
    assert iso_ns(batch["start_time"]) <= iso_ns(model["end_time"]) <= iso_ns(batch["end_time"])


@pytest.fixture
def without_otel(tmp_path) -> dict[str, str]:
    """Environment for a child in which `import opentelemetry` fails, as where the otel
    extra is not installed."""
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\nsys.modules['opentelemetry'] = None  # ImportError on import\n")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), str(ROOT),
                                                        os.environ.get("PYTHONPATH")]))}


def test_everything_works_without_opentelemetry(shared_redis, queue, start_consumer,
                                                without_otel):
    script = f"""
import orjson, redis
from producer import Producer
from scheduler_core import tracing
from scheduler_core.keys import QueueKeys
from scheduler_core.wire import split_job
try:
    import opentelemetry  # noqa: F401
    raise SystemExit("opentelemetry importable")
except ImportError:
    pass
assert not tracing.AVAILABLE and tracing.current_trace() is None
with Producer({shared_redis.url!r}, {queue!r}) as producer:
    handle = producer.submit({{"i": 1}})
    print(split_job(redis.Redis.from_url({shared_redis.url!r}).hget(
        QueueKeys({queue!r}).jobs, handle.id))[1].decode())
    print(handle.result(timeout=30))
"""
    tracer, _ = in_memory()
    consumer = start_consumer(shared_redis.url, queue, "--model", "consumer.models:noop",
                              env=without_otel)
    with Producer(shared_redis.url, queue) as producer, \
            tracer.start_as_current_span("traced, read by a consumer without otel"):
        assert producer.submit({"x": 1}).result(timeout=30) == {"x": 1}
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           timeout=60, env={**os.environ, **without_otel})
    assert child.returncode == 0, child.stderr
    envelope, result = child.stdout.splitlines()
    assert envelope == '{"v":1,"payload":{"i":1}}' and result == "{'i': 1}"
    assert "Traceback" not in consumer.output()

    refused = start_consumer(shared_redis.url, queue, "--otel-exporter", "console",
                             env=without_otel, ready=False)
    assert refused.proc.wait(30) == 2
    assert "pip install 'batchgate[otel]'" in refused.output()


# A user's model module that installs its own TracerProvider (spans to a file).
PROVIDER_MODEL = '''
import os

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(
    out=open(os.environ["SPANS_FILE"], "a"), formatter=lambda s: s.to_json(indent=None) + "\\n")))
trace.set_tracer_provider(provider)


def model(payloads):
    return payloads
'''


def test_consumer_uses_the_provider_its_model_installs_and_none_without(
        shared_redis, queue, start_consumer, tmp_path):
    tracer, _ = in_memory()
    (tmp_path / "traced_model.py").write_text(PROVIDER_MODEL)
    spans_file = tmp_path / "spans.jsonl"
    own = start_consumer(shared_redis.url, queue, "--model", "traced_model:model",
                         cwd=str(tmp_path), env={"SPANS_FILE": str(spans_file)})
    with Producer(shared_redis.url, queue) as producer, \
            tracer.start_as_current_span("request") as span:
        assert producer.submit({"x": 1}).result(timeout=30) == {"x": 1}

    def batch_spans() -> list[dict[str, Any]]:
        text = spans_file.read_text() if spans_file.exists() else ""
        return [s for s in console_spans(text) if s["name"] == "batchgate batch"]
    (batch,) = wait_for(batch_spans, 15, "the batch span in the model's exporter")
    assert [link["context"]["trace_id"] for link in batch["links"]] == \
        [f"0x{span.get_span_context().trace_id:032x}"]
    own.stop()

    # no --otel-exporter and no provider installed: nothing recorded, nothing printed
    plain = start_consumer(shared_redis.url, queue, "--model", "consumer.models:noop")
    with Producer(shared_redis.url, queue) as producer, \
            tracer.start_as_current_span("request"):
        assert producer.submit({"x": 2}).result(timeout=30) == {"x": 2}
    plain.stop()
    assert console_spans(plain.output()) == []
