"""Many queues behind one gateway: `/v1/queues/{queue}/...` beside the routes of the
default (first) queue.

QueueRouter is a pure ASGI layer in front of the hot path: a request to
`/v1/queues/{queue}/<rest>` is served as `/v1/<rest>` against that queue's Gateway (the
`selected` context variable, read by `current`), so that the native routes, their
submit/wait/stream machinery and their errors are the same code for every queue. A
queue the gateway does not serve is answered 404 naming it. Each queue's policy is its
own: it is read from Redis per queue, as by a gateway of that queue alone.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from producer.gateway.guard import Receive, Scope, Send, answer
from scheduler_core.keys import QueueKeys

if TYPE_CHECKING:
    from producer.gateway.app import Gateway

QUEUES_PREFIX = "/v1/queues/"
QUEUE_PATH = QUEUES_PREFIX + "{queue}"  # the spec's prefix of the per-queue routes
PATTERN_CHARS = frozenset("*?[")
NATIVE = frozenset({"requests", "stats"})  # /v1/<these>... are the per-queue routes
# The Gateway a request addresses, set by QueueRouter for the request's own task.
selected: ContextVar[Gateway | None] = ContextVar("batchgate_gateway", default=None)


def current(app: Any) -> Gateway:
    """The Gateway of the request being served: its queue's, or the default queue's."""
    return selected.get() or app.state.gateway


def listed(served: Iterable[str], most: int = 20) -> str:
    """The served queues for an error message: the first `most`, then how many more."""
    names = list(served)
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def unknown_queue(name: str, served: Iterable[str]) -> dict[str, Any]:
    return {"error": "not_found", "message": f"queue {name!r} is not served by this gateway "
                                             f"(serving: {listed(served)})",
            "field": "queue"}


def expand(names: Sequence[str], registered: Iterable[str]) -> list[str]:
    """The queues of `--queue` values, in order, without repeats: a name as it is, a glob
    pattern (`*`, `?`, `[...]`) every registered queue it matches. ValueError if a
    pattern matches none, or a name is not a valid queue name."""
    registered = sorted(registered)
    out: list[str] = []
    for name in names:
        if PATTERN_CHARS & set(name):
            matched = fnmatch.filter(registered, name)
            if not matched:
                raise ValueError(f"--queue {name!r} matches no registered queue "
                                 f"({len(registered)} registered)")
        else:
            QueueKeys(name)  # validates the name
            matched = [name]
        out.extend(queue for queue in matched if queue not in out)
    return out


class QueueRouter:
    """Serves `/v1/queues/{queue}/<rest>` as `/v1/<rest>` for that queue (see the
    module); anything else passes through unchanged."""

    def __init__(self, app: Any, gateways: Any):
        self.app = app
        self.gateways = gateways  # () -> {queue: Gateway}, made in the app's lifespan

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(QUEUES_PREFIX):
            await self.app(scope, receive, send)
            return
        name, _, rest = scope["path"][len(QUEUES_PREFIX):].partition("/")
        gateways = self.gateways()
        gateway = gateways.get(name)
        if gateway is None or rest.partition("/")[0] not in NATIVE:
            await answer(send, 404, unknown_queue(name, gateways) if gateway is None else
                         {"error": "not_found", "message": f"no route {scope['path']!r}"})
            return
        prefix = f"{QUEUES_PREFIX}{name}".encode()
        token = selected.set(gateway)
        try:
            inner = {**scope, "path": "/v1/" + rest,
                     "raw_path": b"/v1/" + rest.encode(), "batchgate.queue": name}
            await self.app(inner, receive, _located(send, prefix))
        finally:
            selected.reset(token)


def _located(send: Send, prefix: bytes) -> Send:
    """`send`, with a Location of a native route rewritten under the queue's prefix."""
    async def located(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            headers = [(key, prefix + value[3:] if key == b"location"
                        and value.startswith(b"/v1/") else value)
                       for key, value in message.get("headers", [])]
            message = {**message, "headers": headers}
        await send(message)
    return located
