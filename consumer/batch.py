"""What a pop hands the consumer loop, and what the loop hands complete.lua.

A pop yields one of four next steps: a Batch to run, Idle (nothing due: block), PopNow
(pop again at once), or ExpireDue (requests past their deadline wait: expire them, then
pop).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from scheduler_core.errors import InvalidRequest
from scheduler_core.wire import DEADLINE, POPPED_STATES, Outcome, delivered_job, encode_error

# request id -> (outcome, encoded result envelope), as complete.lua takes them
Answers = dict[str, tuple[Outcome, bytes]]


class Cost(int):
    """A request's cost as a model that opts in sees it (`accepts_costs = True`, see
    consumer/loader.py): the cost to work to (an int, e.g. max_new_tokens), capped to the
    queue's max_cost when over_cost=truncate capped it; `requested` is what the producer
    asked for and `truncated` says whether it was capped."""

    requested: int

    def __new__(cls, value: int, requested: int | None = None) -> Cost:
        cost = super().__new__(cls, value)
        cost.requested = value if requested is None else requested
        return cost

    @property
    def truncated(self) -> bool:
        return self.requested > self

    def __repr__(self) -> str:
        return f"Cost({int(self)}, requested={self.requested})"


@dataclass
class Item:
    id: str
    envelope: bytes | None
    arrival_us: int
    attempts: int
    producer: str
    state: Outcome  # RUN, or settled at the pop: EXPIRED or DEAD_LETTER
    level: int
    trace: dict[str, str] | None = None  # the producer's trace context, when traced
    cost: int = 1  # as enqueued: capped to max_cost under over_cost=truncate
    requested: int = 1  # the cost its producer asked for (> cost when capped)
    deadline_us: int = 0  # on the queue's clock, as the batch's popped_us; 0 = none


@dataclass
class Batch:
    id: str
    popped_us: int
    items: list[Item]
    remaining: int = 0  # requests still pending after this pop
    # (answers known before the model runs, [(item, decoded payload)]), once decoded
    prepared: tuple[Answers, list[tuple[Item, Any]]] | None = field(default=None, repr=False)
    span: Any = field(default=None, repr=False)  # its open span, when traced (tracing.py)
    # time.monotonic() when the pop's reply was read (a pop sent ahead: when it was sent,
    # as its reply may wait unread for a model run); with popped_us, the queue's clock now
    received_s: float = field(default_factory=time.monotonic, repr=False)

    def past_deadline(self) -> list[Item]:
        """Its requests to run whose deadline has passed since the pop (the pop answers
        those past it then). The queue's clock is not read again: the time since
        `received_s`, on this host's monotonic clock, is added to the pop's `popped_us`.
        That errs by at most the pop's round trip (late from the reply, early from the
        send), and no clock step moves it."""
        now_us = self.popped_us + (time.monotonic() - self.received_s) * 1e6
        return [item for item in self.items
                if item.state is Outcome.RUN and 0 < item.deadline_us <= now_us]


@dataclass(frozen=True)
class Idle:
    """Nothing due: block until `due_in_ms` has passed (None: until an arrival wakes us)."""
    due_in_ms: float | None = None


@dataclass(frozen=True)
class PopNow:
    """Pop at once: nothing rode in with the last completion."""


@dataclass(frozen=True)
class ExpireDue:
    """pop_batch.lua's {-4}: a waiting request is past its deadline; expire_due first."""


IDLE_UNTIL_WOKEN = Idle()
POP_NOW = PopNow()
EXPIRE_DUE = ExpireDue()
Next = Batch | Idle | PopNow  # what the consumer loop does next


@dataclass
class Finished:
    """(Part of) a batch's answers on their way to complete.lua."""
    batch: Batch
    outcomes: Answers  # already encoded (expired, dead, malformed)
    runnable: list[Item] = field(default_factory=list)
    results: list[tuple[bool, Any]] = field(default_factory=list)  # per runnable item
    model_us: int = 0
    answered_early: Answers = field(default_factory=dict)
    last: bool = True  # the batch's final completion: observed, its model time recorded
    # the complete.lua call (script, keys, args), once the answers are encoded
    call: tuple[Any, list[str], list[Any]] | None = field(default=None, repr=False)
    refused: bool = False  # complete.lua said the batch is stale (its lease lapsed)


def parse_pop(reply: list[Any]) -> Batch | Idle | ExpireDue:
    """pop_batch.lua's reply: a Batch, Idle until the next request falls due, or
    ExpireDue. LookupError if the queue has no policy."""
    head = int(reply[0])
    if head == -4:
        return EXPIRE_DUE
    if head == 0:
        wait_us = int(reply[1])
        return Idle(wait_us / 1000) if wait_us >= 0 else IDLE_UNTIL_WOKEN
    if head == -1:
        raise LookupError("queue has no policy")
    if head < 0:
        raise InvalidRequest(reply[1].decode(), "rejected by pop_batch")
    items = []
    state_of, run = POPPED_STATES.get, Outcome.RUN  # an Enum lookup per item is slow
    for i in range(4, len(reply), 5):
        rid, raw, attempts, state, level = reply[i:i + 5]
        arrival, producer, cost, requested, envelope, deadline = delivered_job(raw)
        items.append(Item(rid.decode(), envelope, arrival, attempts, producer,
                          state_of(state, run), level, cost=cost, requested=requested,
                          deadline_us=deadline))
    return Batch(str(head), int(reply[1]), items, remaining=int(reply[3]))


def expired_answer(item: Item) -> tuple[Outcome, bytes]:
    """The answer of a held request whose deadline passed before it ran."""
    return Outcome.EXPIRED, encode_error(item.id, DEADLINE,
                                         "deadline passed before a consumer ran it")


def describe_error(exc: BaseException) -> str:
    """The exception's message; a model's exception whose __str__ raises must fail its
    request, not the consumer."""
    try:
        return str(exc)
    except Exception:  # any failure to print is the model's, not ours
        return "<unprintable>"
