"""What Producer and AsyncProducer share: configuration, the handle registry and the
script arguments. The subclasses add only their I/O (threads or asyncio)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any, Generic, Literal, TypeVar

from producer.validation import (
    ProducerConfig,
    build_requests,
    cancel_envelope,
    local_deadline,
    new_id,
)
from scheduler_core.keys import QueueKeys
from scheduler_core.scripts import NewRequest, cancel_keys, enqueue_call
from scheduler_core.wire import Result, decode_result

log = logging.getLogger("batchgate.producer")

CancelOutcome = Literal["cancelled", "running", "finished"]
CANCEL_OUTCOMES: dict[int, CancelOutcome] = {1: "cancelled", 2: "running", 0: "finished"}
POLL_S = 1.0  # a waiting handle re-checks `result:<id>` this often (lost-inbox fallback)

H = TypeVar("H")
# Called by the listener for every result this producer's inbox delivers, before the
# handle is resolved (the demo and the benchmark stamp arrival times with it).
OnResult = Callable[[Result], None]


class ProducerBase(Generic[H]):
    def __init__(self, queue: str, max_payload_bytes: int | None,
                 idempotency_ttl_s: int | None, on_result: OnResult | None = None):
        overrides = {k: v for k, v in (("max_payload_bytes", max_payload_bytes),
                                       ("idempotency_ttl_s", idempotency_ttl_s)) if v is not None}
        self.config = ProducerConfig(queue=queue, **overrides)
        self.keys = QueueKeys(queue)
        self.id = new_id()
        self._handles: dict[str, H] = {}
        self._lock = threading.Lock()  # the sync listener thread resolves handles too
        self._on_result = on_result

    def _prepare(self, payloads: Iterable[Any], priority: Any, deadline_ms: Any,
                 idempotency_keys: list[str | None] | None,
                 make_handle: Callable[[str], H]) -> tuple[list[NewRequest], list[H],
                                                           list[str], list[Any]]:
        """Validate (raising before any write), register handles, build the enqueue call.
        Handles are registered first so that no result can arrive before its handle."""
        requests = build_requests(self.config, payloads, priority, deadline_ms,
                                  idempotency_keys)
        handles = [make_handle(r.id) for r in requests]
        with self._lock:
            for r, h in zip(requests, handles, strict=True):
                self._handles[r.id] = h
        keys, args = enqueue_call(self.keys, self.id, requests, self.config.idempotency_ttl_s)
        return requests, handles, keys, args

    def _forget(self, requests: list[NewRequest]) -> None:
        with self._lock:
            for r in requests:
                self._handles.pop(r.id, None)

    def _accepted(self, requests: list[NewRequest], handles: list[H], ids: list[str]) -> None:
        """Arm deadlines; an idempotent duplicate is answered under the first request's id."""
        with self._lock:
            for request, h, effective in zip(requests, handles, ids, strict=True):
                h._deadline_at = local_deadline(request.deadline_ms)  # type: ignore[attr-defined]
                if effective != request.id:
                    self._handles.pop(request.id, None)
                    h.id = effective  # type: ignore[attr-defined]
                    self._handles[effective] = h

    def _take(self, request_id: str) -> H | None:
        with self._lock:
            return self._handles.pop(request_id, None)

    def _deliver(self, raw: bytes) -> None:
        """Resolve the handle an inbox item belongs to. Called once per result envelope
        the inbox delivers, after the `on_result` hook."""
        try:
            result = decode_result(raw)
        except (ValueError, KeyError) as exc:
            log.error("dropping malformed result envelope: %s", exc)
            return
        if self._on_result is not None:
            try:
                self._on_result(result)
            except Exception:  # a broken hook must not stop the listener
                log.exception("on_result hook failed for %s", result.id)
        handle = self._take(result.id)
        if handle is not None:
            handle._resolve(result)  # type: ignore[attr-defined]

    def _cancel_call(self, request_id: str, deadline: bool) -> tuple[list[str], list[Any], bytes]:
        envelope, counter = cancel_envelope(request_id, deadline)
        return (cancel_keys(self.keys, request_id, self.id),
                [request_id, self.config.result_ttl_s, envelope, counter], envelope)

    def _cancelled(self, handle: H, reply: Any, envelope: bytes) -> CancelOutcome:
        outcome = CANCEL_OUTCOMES[int(reply)]
        if outcome == "cancelled":
            self._take(handle.id)  # type: ignore[attr-defined]
            handle._resolve(decode_result(envelope))  # type: ignore[attr-defined]
        return outcome

    def _resolve_stored(self, handle: H, result: Result | None) -> bool:
        if result is None:
            return False
        self._take(handle.id)  # type: ignore[attr-defined]
        handle._resolve(result)  # type: ignore[attr-defined]
        return True
