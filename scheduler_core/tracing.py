"""OpenTelemetry trace context across the queue (the `otel` extra): W3C `traceparent`
(and `tracestate`) from the producer's active span, carried in the request envelope
(wire.py) to the consumer, whose spans link back to it (consumer/tracing.py).

Without opentelemetry installed, or with no span active, `current_trace()` is None and the
envelope carries nothing more. The import is tried once, here.
"""

from __future__ import annotations

from typing import Any

try:
    from opentelemetry import trace as _trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the `otel` extra is not installed: tracing is off, at no cost
    _trace = None
    _PROPAGATOR: Any = None
else:
    # W3C trace context always, whatever propagators the application set globally: this
    # is batchgate's own wire format, read by batchgate's consumers.
    _PROPAGATOR = TraceContextTextMapPropagator()

AVAILABLE = _trace is not None


def current_trace() -> dict[str, str] | None:
    """The active span's W3C trace context ({"traceparent": ..., ["tracestate": ...]}), or
    None: opentelemetry missing, or no valid span active."""
    if _trace is None or not _trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier or None


def extract(trace: dict[str, str]) -> Any:
    """The opentelemetry Context of a carried trace, or None if it holds no valid span
    context (or opentelemetry is missing)."""
    if _trace is None:
        return None
    context = _PROPAGATOR.extract(trace)
    return context if _trace.get_current_span(context).get_span_context().is_valid else None
