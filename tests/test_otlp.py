"""`batchgate consumer --otel-exporter otlp --otel-endpoint URL`: the consumer's spans reach
a collector over OTLP/HTTP. The collector is a receiver started by the test on 127.0.0.1:
it takes POST /v1/traces (protobuf) and decodes it with the opentelemetry-proto classes."""

from __future__ import annotations

import gzip
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from helpers.support import wait_for

from batchgate.cli import main as cli
from consumer.config import ConsumerConfig
from consumer.tracing import otlp_traces_url
from producer import Producer
from scheduler_core.errors import InvalidRequest

sdk_trace = pytest.importorskip("opentelemetry.sdk.trace")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

ROOT = Path(__file__).resolve().parent.parent
FLUSH_MS = 200  # OTEL_BSP_SCHEDULE_DELAY the consumer runs with: how often it sends


def _value(any_value: Any) -> Any:
    return getattr(any_value, any_value.WhichOneof("value"))


class Receiver:
    """An OTLP/HTTP trace receiver on 127.0.0.1: every span it was sent, as dicts."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.paths: list[str] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.add(self.path, self.headers.get("Content-Type"), request)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, path: str, content_type: str | None, request: Any) -> None:
        with self.lock:
            self.paths.append(f"{path} {content_type}")
            for resource_spans in request.resource_spans:
                resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append({
                            "name": span.name, "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent_id": span.parent_span_id.hex(),
                            "attributes": {a.key: _value(a.value) for a in span.attributes},
                            "links": [link.trace_id.hex() for link in span.links],
                            "resource": resource})

    def named(self, name: str) -> list[dict[str, Any]]:
        with self.lock:
            return [s for s in self.spans if s["name"] == name]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def test_consumer_sends_its_spans_to_an_otlp_collector(shared_redis, queue, start_consumer,
                                                       receiver):
    spans = InMemorySpanExporter()
    provider = sdk_trace.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    tracer = provider.get_tracer("test")
    consumer = start_consumer(shared_redis.url, queue, "--model", "consumer.models:noop",
                              "--otel-exporter", "otlp", "--otel-endpoint", receiver.url,
                              env={"OTEL_BSP_SCHEDULE_DELAY": str(FLUSH_MS)})
    with Producer(shared_redis.url, queue) as producer:
        with tracer.start_as_current_span("web request") as parent:
            handle = producer.submit({"x": 1})
        assert handle.result(timeout=30) == {"x": 1}
    trace_id = f"{parent.get_span_context().trace_id:032x}"
    (batch,) = wait_for(lambda: receiver.named("batchgate batch"), 15, "the batch span")
    assert batch["links"] == [trace_id]
    assert batch["attributes"]["batchgate.batch.size"] == 1
    assert batch["attributes"]["batchgate.queue"] == queue
    assert batch["resource"]["service.name"] == "batchgate-consumer"
    (wait,) = wait_for(lambda: receiver.named("batchgate queue wait"), 15, "the wait span")
    assert (wait["trace_id"], wait["parent_id"]) == (
        trace_id, f"{parent.get_span_context().span_id:016x}")
    assert wait["attributes"]["batchgate.request.id"] == handle.id
    (model,) = wait_for(lambda: receiver.named("batchgate model"), 15, "the model span")
    assert (model["trace_id"], model["parent_id"]) == (batch["trace_id"], batch["span_id"])
    assert set(receiver.paths) == {"/v1/traces application/x-protobuf"}
    assert "Traceback" not in consumer.output()


def test_otlp_endpoint_is_checked_and_completed():
    assert otlp_traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert otlp_traces_url("http://c:4318/") == "http://c:4318/v1/traces"
    assert otlp_traces_url("https://c/custom/path") == "https://c/custom/path"
    assert ConsumerConfig(otel_exporter="otlp").otel_endpoint is None
    for exporter, endpoint in [("none", "http://c:4318"), ("console", "http://c:4318"),
                               ("otlp", "collector:4318"), ("otlp", "ftp://c"),
                               ("otlp", "http://"), ("otlp", "http://c:99999"),
                               ("otlp", "http://c/ x")]:
        with pytest.raises(InvalidRequest) as info:
            ConsumerConfig(otel_exporter=exporter, otel_endpoint=endpoint)
        assert info.value.field == "otel_endpoint", (exporter, endpoint)


def test_the_cli_refuses_a_bad_endpoint_before_anything_starts():
    result = CliRunner().invoke(cli, [
        "consumer", "--redis-url", "redis://127.0.0.1:1", "--otel-exporter", "otlp",
        "--otel-endpoint", "not a url"])
    assert result.exit_code == 2, result.output
    assert "otel_endpoint" in result.output


def test_without_the_exporter_package_the_consumer_names_it(shared_redis, queue,
                                                            start_consumer, tmp_path):
    """Where opentelemetry-exporter-otlp-proto-http is missing (the SDK installed): exit 2
    at start, naming the package and the extra."""
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\nsys.modules['opentelemetry.exporter'] = None  # ImportError\n")
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), str(ROOT),
                                                        os.environ.get("PYTHONPATH")]))}
    refused = start_consumer(shared_redis.url, queue, "--otel-exporter", "otlp",
                             env=env, ready=False)
    assert refused.proc.wait(30) == 2
    assert "opentelemetry-exporter-otlp-proto-http" in refused.output()
    assert "pip install 'batchgate[otel]'" in refused.output()
