"""OpenTelemetry spans of the consumer's batches (the `otel` extra).

For every batch the model ran:
- `batchgate queue wait`, one per request that carries a trace context (the producer's
  span, scheduler_core/tracing.py): a child of that span, from the enqueue to the pop
  (Redis' clock), so each request's own trace shows its wait;
- `batchgate batch`: the pop to the write of the results; a root span with a link to
  every traced request's span (a batch serves many traces), attributes batch id, size,
  strategy and queue;
- `batchgate model`: the model's run, a child of the batch span.

`batchgate consumer --otel-exporter console` installs an SDK TracerProvider that prints
each span as one JSON line on stdout; `--otel-exporter otlp` one that sends them to a
collector over OTLP/HTTP (protobuf; `--otel-endpoint`), in batches from a thread of its
own (the SDK's BatchSpanProcessor: OTEL_BSP_* apply), flushed at exit; otherwise the
global TracerProvider is used if the application set one (e.g. its model module). With
neither, or without opentelemetry, the consumer records nothing and pays nothing
(`tracer_for` returns None).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

from consumer.batch import Batch, Item
from scheduler_core.tracing import AVAILABLE, extract


class BatchTracer:
    """Records the spans of one consumer's batches through `tracer`."""

    def __init__(self, queue: str, tracer: Any):
        from opentelemetry import trace
        from opentelemetry.context import Context

        self._trace, self._root = trace, Context()  # an empty context: a new trace
        self.queue, self.tracer = queue, tracer

    def model_ran(self, batch: Batch, runnable: list[Item], strategy: str, started_ns: int,
                  ended_ns: int, failed: int) -> Any:
        """Record the waits and the model run; return the batch span, still open (ended by
        `completed`)."""
        trace, popped_ns = self._trace, batch.popped_us * 1000
        links = []
        for item in batch.items:
            context = extract(item.trace) if item.trace else None
            if context is None:
                continue
            wait = self.tracer.start_span(
                "batchgate queue wait", context=context, kind=trace.SpanKind.CONSUMER,
                start_time=item.arrival_us * 1000,
                attributes={"batchgate.queue": self.queue, "batchgate.request.id": item.id,
                            "batchgate.priority": item.level,
                            "batchgate.attempts": item.attempts})
            wait.end(end_time=max(popped_ns, item.arrival_us * 1000))
            links.append(trace.Link(trace.get_current_span(context).get_span_context(),
                                    {"batchgate.request.id": item.id}))
        span = self.tracer.start_span(
            "batchgate batch", context=self._root, kind=trace.SpanKind.CONSUMER, links=links,
            start_time=min(popped_ns, started_ns),
            attributes={"batchgate.queue": self.queue, "batchgate.batch.id": batch.id,
                        "batchgate.batch.size": len(batch.items),
                        "batchgate.strategy": strategy})
        model = self.tracer.start_span(
            "batchgate model", context=trace.set_span_in_context(span), start_time=started_ns,
            attributes={"batchgate.batch.size": len(runnable), "batchgate.failed": failed})
        if failed:
            model.set_status(trace.StatusCode.ERROR, f"{failed} of {len(runnable)} failed")
        model.end(end_time=ended_ns)
        return span

    def completed(self, span: Any, error: BaseException | None = None) -> None:
        if error is not None:
            span.record_exception(error)
            span.set_status(self._trace.StatusCode.ERROR, type(error).__name__)
        span.end()


def tracer_for(queue: str) -> BatchTracer | None:
    """The consumer's BatchTracer on the global TracerProvider (installed by
    `install_console_provider`, or by the application, e.g. in its model module), or None
    when spans would go nowhere: opentelemetry missing, or no provider installed."""
    if not AVAILABLE:
        return None
    from opentelemetry import trace

    if isinstance(trace.get_tracer_provider(),
                  (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        return None  # the API's default: every span would be dropped
    return BatchTracer(queue, trace.get_tracer("batchgate.consumer"))


OTLP_TRACES_PATH = "/v1/traces"  # OTLP/HTTP's path for traces


def otlp_traces_url(endpoint: str) -> str:
    """The URL spans are POSTed to: `endpoint` as given, or with /v1/traces added when it
    names no path (http://collector:4318)."""
    scheme, netloc, path, query, fragment = urlsplit(endpoint)
    if path in ("", "/"):
        path = OTLP_TRACES_PATH
    return urlunsplit((scheme, netloc, path, query, fragment))


def _sdk_provider(processor: Any) -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES apply (Resource.create reads them).
    # The provider flushes its processor at exit (shutdown_on_exit).
    provider = TracerProvider(resource=Resource.create({"service.name": "batchgate-consumer"}))
    provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)


def install_otlp_provider(endpoint: str | None = None) -> None:
    """Install, globally, an SDK TracerProvider exporting spans over OTLP/HTTP to
    `endpoint` (None: the exporter's OTEL_EXPORTER_OTLP_* variables, else
    http://localhost:4318/v1/traces); ValueError without the exporter package."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        raise ValueError("--otel-exporter otlp needs opentelemetry-sdk and "
                         "opentelemetry-exporter-otlp-proto-http: pip install "
                         "'batchgate[otel]'") from None
    exporter = OTLPSpanExporter(endpoint=otlp_traces_url(endpoint) if endpoint else None)
    _sdk_provider(BatchSpanProcessor(exporter))


def install_console_provider() -> None:
    """Install, globally, an SDK TracerProvider printing one JSON line per span on stdout
    (`--otel-exporter console`); ValueError without opentelemetry-sdk."""
    try:
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
    except ImportError:
        raise ValueError("--otel-exporter console needs opentelemetry-sdk: pip install "
                         "'batchgate[otel]'") from None
    _sdk_provider(SimpleSpanProcessor(ConsoleSpanExporter(
        formatter=lambda span: span.to_json(indent=None) + "\n")))
