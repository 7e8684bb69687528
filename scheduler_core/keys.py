"""The key schema: every Redis key batchgate uses, in one place.

All keys of a queue share the hash tag `{bg:<queue>}`, so they live in one cluster slot
and one Lua script may touch them all. Every key a script touches is passed in KEYS: the
queue's shared keys it takes first, as KEYS[1..n] in the order of script_keys(script)
(all 43 of SHARED_KEYS, unless SCRIPT_KEYS names fewer), then the script's per-call keys
(result:<id>, inbox:<producer>, idem:<key>).

| key                         | type   | holds                                                     |
|-----------------------------|--------|-----------------------------------------------------------|
| `{bg:q}:policy`             | hash   | the queue's Policy (see policy.py)                        |
| `{bg:q}:pending:<0|1|2>`    | zset   | waiting request ids per priority, score = arrival (µs)    |
| `{bg:q}:jobs`               | hash   | id -> "<meta>|<envelope>": the request's meta          |
|                             |        | "orig_prio:arrival_us:deadline_us:attempts:keep:producer"|
|                             |        | then ":cost" if cost != 1, ":cost:requested" if capped,  |
|                             |        | then '|' and the request envelope (orjson bytes);       |
|                             |        | attempts: deliveries ended without a result; keep: 1 if  |
|                             |        | the result is stored by id (wire.JobMeta, split_job)     |
| `{bg:q}:costs`              | hash   | id -> "<cost>:<bucket>:<prio>" of each waiting request   |
|                             |        | (pending or delayed): its cost, the cost bucket set it   |
|                             |        | is listed in (1..5; 0: none) and the priority it was     |
|                             |        | submitted at (an older version wrote none), so that a    |
|                             |        | pop learns costs, and aging submitted priorities,        |
|                             |        | without reading payloads and every exit (pop, cancel,    |
|                             |        | expiry) removes the id from the set it was put in,       |
|                             |        | whatever cost_buckets says now (wire.cost_record). Its   |
|                             |        | field "~relist" (no id has '~'), while set after a      |
|                             |        | cost_buckets change, is the HSCAN cursor of the pops     |
|                             |        | re-listing the waiting requests (pop_batch relist_step)  |
| `{bg:q}:retry`              | zset   | id -> when it may run again (µs): its model raised a     |
|                             |        | retry_on exception; pop_batch moves it back to its level |
|                             |        | (arrival kept) once due, or at its deadline if earlier   |
| `{bg:q}:owner`              | hash   | id -> batch id, while the request is in flight            |
| `{bg:q}:inflight`           | zset   | batch id -> lease deadline (µs)                           |
| `{bg:q}:batches`            | hash   | batch id -> "consumer|id,id,..."                          |
| `{bg:q}:clock`              | string | the queue's clock: "<latest>[:<offset>]", the latest time |
|                             |        | a script showed or issued as an arrival score (keeps      |
|                             |        | arrival order strict) and the offset added to TIME after  |
|                             |        | a backward step (lua/_common.lua, queue_now)              |
| `{bg:q}:seq`                | string | batch id counter; a batch id is its fencing token         |
| `{bg:q}:marker`             | zset   | wake-up marker idle consumers block on (BZPOPMIN)         |
| `{bg:q}:marker:<1..5>`      | zset   | the wake-up marker of the consumers dedicated to cost     |
|                             |        | bucket 1..5 (--only-bucket): woken by that bucket's       |
|                             |        | arrivals (and by re-queues and batches that leave work)   |
| `{bg:q}:bucket:<1..5>`      | zset   | with cost_buckets: the ids waiting in cost bucket 1..5,   |
|                             |        | score = arrival (all levels and the delayed set), for the |
|                             |        | consumers dedicated to it; a pop, cancel or expiry takes  |
|                             |        | the id out of the set its costs entry names               |
| `{bg:q}:wake:<consumer>`    | zset   | a consumer's private wake-up key (its own due timer)      |
| `{bg:q}:consumers`          | zset   | consumer name -> last heartbeat (µs)                      |
| `{bg:q}:stats`              | hash   | counters: processed, failed, batches, ...                 |
| `{bg:q}:samples:wait`       | list   | newest 10,000 queue waits (µs)                            |
| `{bg:q}:samples:e2e`        | list   | newest 10,000 enqueue-to-result times (µs)                |
| `{bg:q}:samples:model`      | list   | newest 10,000 batches as "size:model_us"                  |
|                             |        | (each list is trimmed back to 10,000 at 10,500 entries)   |
| `{bg:q}:dead`               | zset   | dead-lettered ids -> time (µs); envelope kept in jobs     |
| `{bg:q}:dead:reason`        | hash   | dead-lettered id -> reason                                |
| `{bg:q}:deadlines`         | zset   | waiting id -> its deadline (µs), for requests with one    |
|                             |        | (enqueue adds, pop/cancel/expire_due remove)              |
| `{bg:q}:delayed`           | zset   | id -> arrival (µs): past its deadline under on_timeout =  |
|                             |        | delay; runs when no level waits (expire_due moves it)     |
| `{bg:q}:arrivals`          | hash   | epoch second -> requests enqueued (the measured rate)     |
| `{bg:q}:cost_model`        | hash   | the fitted model time A + B·b (µs) and where it came from |
| `{bg:q}:tenants`           | hash   | per named tenant t (docs/tenants.md): w:t waiting, f:t in |
|                             |        | flight (removed at 0), a:t accepted, r:t refused by a     |
|                             |        | quota, s:t served (ran), sc:t cost served                 |
| `{bg:q}:tenant_rate`       | hash   | per tenant with a rate quota: q:t / c:t token buckets     |
|                             |        | (requests / cost) as "tokens:at_us" on the queue's clock  |
| `{bg:q}:fair:<0|1|2>`      | zset   | fairness requests/cost only (lua/_fair.lua): each waiting |
|                             |        | request of the level as "<tenant>|<arrival, 17 digits>|  |
|                             |        | <id>", score 0: by tenant, then arrival (ZRANGEBYLEX)     |
| `{bg:q}:vtc:<0|1|2>`       | zset   | the tenants with requests waiting at the level -> their   |
|                             |        | virtual counter (weighted service at that level); a      |
|                             |        | tenant leaves it with its last request there              |
| `{bg:q}:fair:who`          | hash   | id -> tenant of each request in a fair set; `<L>|<tenant>` |
|                             |        | -> that tenant's first requests at L (a pop's head cache) |
| `{bg:q}:consumer:<name>`    | hash   | a consumer's host, pid, device, batches, current batch;   |
|                             |        | written with each heartbeat, expires 30 s after the last  |
| `{bg:q}:failures`           | list   | newest 100 failed requests (orjson), by the lease thread  |
| `{bg:q}:attempts:<id>`      | list   | a retried request's failed runs (orjson: attempt, type,   |
|                             |        | message), by complete.lua; read into its dead-letter      |
|                             |        | entry when retries run out; expires (result_ttl_s + wait) |
| `{bg:q}:result:<id>`        | string | result envelope, expires after result_ttl_s; written only |
|                             |        | for a request submitted with store_result (or an          |
|                             |        | idempotency key): the inbox gets every result             |
| `{bg:q}:inbox:<producer>`   | list   | result envelopes for one Producer instance, expires       |
| `{bg:q}:stream:<id>`        | stream | partial results of a streaming model (capped, expires     |
|                             |        | after result_ttl_s), docs/streaming.md                    |
| `{bg:q}:idem:<key>`         | string | idempotency key -> request id, expires                    |
| `{bg:q}:acks`               | string | counter written before each WAIT of `wait_replicas`       |

A sharded queue (policy field `shards` = S > 1, scheduler_core/shards.py) is S physical
queues: shard 0 is the queue itself, shard i the queue `<queue>#<i>` with every key above
under its own tag `{bg:<queue>#<i>}` (so its own cluster slot). '#' is not allowed in a
queue name a user gives, so shards never collide with other queues.

How readers find queues (scheduler_core/registry.py): a key of each queue's own, found
by SCAN; no key is shared between queues.

| key                         | type   | holds                                                     |
|-----------------------------|--------|-----------------------------------------------------------|
| `{bg:q}:seen`               | string | last seen (ms since the epoch), set by its users          |

Bulk jobs (producer/bulk) keep their state outside any queue:

| key                         | type   | holds                                                     |
|-----------------------------|--------|-----------------------------------------------------------|
| `batchgate:bulk:<job>`      | hash   | the job's checkpoint and progress (producer/bulk/state.py)|
| `batchgate:bulk:<job>:lease`| string | token of the run writing the job's output, expires        |
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from scheduler_core.errors import InvalidRequest
from scheduler_core.policy import MAX_COST_BUCKETS

# Checked with fullmatch: `$` alone also matches before a final "\n", so "q\n" would pass.
QUEUE_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
MAX_QUEUE_NAME = 128
_SHARD_INDEX = re.compile(r"[1-9][0-9]{0,2}")
# A consumer whose last heartbeat in `{bg:q}:consumers` is older than this counts as gone
# (it heartbeats at least every second while running).
CONSUMER_ALIVE_S = 5.0

# The queue's shared keys, as every script receives them (KEYS[1..43], this order) and
# names them at the top of its body (`local pending_high = KEYS[2]`; the per-bucket keys
# as one table each, `local bucket_markers = {KEYS[24], ...}`); QueueKeys has a property
# of each name. A script's per-call keys come after them.
BUCKET_MARKERS = tuple(f"bucket_marker_{b}" for b in range(1, MAX_COST_BUCKETS + 2))
BUCKET_SETS = tuple(f"bucket_set_{b}" for b in range(1, MAX_COST_BUCKETS + 2))
# Fair share between tenants (lua/_fair.lua, docs/tenants.md), per level HIGH, NORMAL, LOW:
# the waiting requests in tenant order, and the backlogged tenants by virtual counter.
FAIR_SETS = tuple(f"fair_set_{level}" for level in range(3))
FAIR_COUNTERS = tuple(f"fair_counters_{level}" for level in range(3))
# Fields of {bg:q}:stats that held the queue's clock before it moved into the clock key
# (lua/_common.lua, queue_now): readers drop them from the counters they show.
CLOCK_OFFSET, CLOCK_SEEN = "clock_offset_us", "clock_seen_us"


def clock_offset_us(clock: Any) -> int:
    """The queue's clock offset (µs) from its clock key's value, "<latest>" or
    "<latest>:<offset>" (None, or a value written by hand: 0, as queue_now reads it)."""
    text = clock.decode() if isinstance(clock, bytes) else str(clock or "")
    _, sep, offset = text.partition(":")
    return int(offset) if sep and offset.isdigit() and len(offset) < 16 else 0


def queue_clock_us(time_reply: Any, clock: Any) -> int:
    """The queue's clock (µs) from a TIME reply read beside its clock key's value: TIME
    plus the offset the scripts keep there (lua/_common.lua, queue_now)."""
    return int(time_reply[0]) * 1_000_000 + int(time_reply[1]) + clock_offset_us(clock)


SHARED_KEYS = ("policy", "pending_high", "pending_normal", "pending_low", "jobs", "costs",
               "clock", "marker", "stats", "inflight", "owner", "batches", "seq", "consumers",
               "dead", "dead_reason", "wait_samples", "e2e_samples", "model_samples",
               "deadlines", "delayed", "arrivals", "cost_model", *BUCKET_MARKERS,
               *BUCKET_SETS, "retry", "tenants", "tenant_rate", *FAIR_SETS, *FAIR_COUNTERS,
               "fair_who")


# The shared keys a script takes, when it takes fewer than all of SHARED_KEYS: its
# KEYS[1..n] in this order (its per-call keys after them). Each key passed costs the call
# itself ~1 k instructions inside Redis, whether the script touches it or not, so a hot
# script is passed only what it uses. A script not named here takes SHARED_KEYS. The
# script's header and its `local name = KEYS[i]` lines follow this list
# (tests/test_lua.py checks both).
SCRIPT_KEYS: dict[str, tuple[str, ...]] = {
    "enqueue": ("policy", "pending_high", "pending_normal", "pending_low", "jobs", "costs",
                "clock", "marker", "stats", "deadlines", "arrivals", *BUCKET_MARKERS,
                *BUCKET_SETS, "tenants", "tenant_rate", *FAIR_SETS, *FAIR_COUNTERS,
                "fair_who"),
    "complete": ("policy", "jobs", "clock", "stats", "inflight", "owner", "batches", "dead",
                 "dead_reason", "e2e_samples", "model_samples", "retry", "marker",
                 *BUCKET_MARKERS, "tenants"),
    "cancel": ("policy", "pending_high", "pending_normal", "pending_low", "jobs", "costs",
               "stats", "owner", "deadlines", "delayed", *BUCKET_SETS, "retry", "tenants",
               *FAIR_SETS, *FAIR_COUNTERS, "fair_who"),
    "extend_lease": ("clock", "inflight", "consumers"),
    "stream_append": ("inflight", "owner"),
}


def script_keys(script: str) -> tuple[str, ...]:
    """The names of the shared keys `script` takes, in order (its KEYS[1..n])."""
    return SCRIPT_KEYS.get(script, SHARED_KEYS)


def validate_queue_name(name: object, field: str = "queue") -> str:
    if not isinstance(name, str) or not QUEUE_NAME.fullmatch(name):
        raise InvalidRequest(
            field,
            f"{name!r} is not a valid queue name: 1-{MAX_QUEUE_NAME} characters from "
            "letters, digits, '_', '.', ':' and '-' (no braces or spaces)",
        )
    return name


@dataclass(frozen=True)
class QueueKeys:
    queue: str

    def __post_init__(self) -> None:
        # A shard's physical queue (`<queue>#<i>`, scheduler_core/shards.py) is a queue too.
        base, sep, index = self.queue.rpartition("#") if isinstance(self.queue, str) else \
            ("", "", "")
        if sep and _SHARD_INDEX.fullmatch(index):
            validate_queue_name(base)
        else:
            validate_queue_name(self.queue)

    @functools.cached_property
    def tag(self) -> str:
        return f"{{bg:{self.queue}}}"

    def _k(self, suffix: str) -> str:
        return f"{self.tag}:{suffix}"

    @property
    def policy(self) -> str:
        return self._k("policy")

    def pending(self, priority: int) -> str:
        return self._k(f"pending:{int(priority)}")

    @property
    def pending_all(self) -> list[str]:
        return [self.pending(p) for p in range(3)]

    @property
    def pending_high(self) -> str:
        return self.pending(0)

    @property
    def pending_normal(self) -> str:
        return self.pending(1)

    @property
    def pending_low(self) -> str:
        return self.pending(2)

    @functools.cached_property
    def shared(self) -> tuple[str, ...]:
        """KEYS[1..43] of every script: the keys of SHARED_KEYS, in that order."""
        def key(name: str) -> str:
            if name in BUCKET_MARKERS:
                return self.bucket_marker(BUCKET_MARKERS.index(name) + 1)
            if name in BUCKET_SETS:
                return self.bucket_set(BUCKET_SETS.index(name) + 1)
            if name in FAIR_SETS:
                return self.fair_set(FAIR_SETS.index(name))
            if name in FAIR_COUNTERS:
                return self.fair_counters(FAIR_COUNTERS.index(name))
            return getattr(self, name)
        return tuple(key(name) for name in SHARED_KEYS)

    def of_script(self, script: str) -> tuple[str, ...]:
        """KEYS[1..n] of `script`: the shared keys it takes (script_keys), in that order."""
        names = SCRIPT_KEYS.get(script)
        if names is None:
            return self.shared
        cache = self.__dict__.setdefault("_of_script", {})
        found = cache.get(script)
        if found is None:
            index = {name: key for name, key in zip(SHARED_KEYS, self.shared, strict=True)}
            found = cache[script] = tuple(index[name] for name in names)
        return found

    @property
    def jobs(self) -> str:
        return self._k("jobs")

    @property
    def costs(self) -> str:
        return self._k("costs")

    @property
    def retry(self) -> str:
        return self._k("retry")

    @property
    def owner(self) -> str:
        return self._k("owner")

    @property
    def inflight(self) -> str:
        return self._k("inflight")

    @property
    def batches(self) -> str:
        return self._k("batches")

    @property
    def clock(self) -> str:
        return self._k("clock")

    @property
    def seq(self) -> str:
        return self._k("seq")

    @property
    def marker(self) -> str:
        return self._k("marker")

    def bucket_marker(self, bucket: int) -> str:
        """The marker that consumers dedicated to cost bucket `bucket` (1-based) block on."""
        return self._k(f"marker:{int(bucket)}")

    def bucket_set(self, bucket: int) -> str:
        """The ids waiting in cost bucket `bucket` (1-based), for its dedicated consumers."""
        return self._k(f"bucket:{int(bucket)}")

    def wake(self, consumer: str) -> str:
        return self._k(f"wake:{consumer}")

    @property
    def consumers(self) -> str:
        return self._k("consumers")

    @property
    def seen(self) -> str:
        """The queue's mark for readers that find queues (scheduler_core/registry.py)."""
        return self._k("seen")

    @property
    def stats(self) -> str:
        return self._k("stats")

    @property
    def wait_samples(self) -> str:
        return self._k("samples:wait")

    @property
    def e2e_samples(self) -> str:
        return self._k("samples:e2e")

    @property
    def model_samples(self) -> str:
        return self._k("samples:model")

    @property
    def dead(self) -> str:
        return self._k("dead")

    @property
    def dead_reason(self) -> str:
        return self._k("dead:reason")

    @property
    def deadlines(self) -> str:
        return self._k("deadlines")

    @property
    def delayed(self) -> str:
        return self._k("delayed")

    @property
    def arrivals(self) -> str:
        return self._k("arrivals")

    @property
    def cost_model(self) -> str:
        return self._k("cost_model")

    @property
    def tenants(self) -> str:
        """Per named tenant's counters (lua/_tenants.lua)."""
        return self._k("tenants")

    @property
    def tenant_rate(self) -> str:
        """Per tenant's rate-quota token buckets (lua/_tenants.lua)."""
        return self._k("tenant_rate")

    def fair_set(self, level: int) -> str:
        """The requests waiting at `level` (0-2) as "<tenant>|<arrival>|<id>", by tenant
        (lua/_fair.lua): written only under fairness requests or cost."""
        return self._k(f"fair:{int(level)}")

    def fair_counters(self, level: int) -> str:
        """The tenants with requests waiting at `level` -> their virtual counter."""
        return self._k(f"vtc:{int(level)}")

    @property
    def fair_who(self) -> str:
        """Request id -> tenant, for each request listed in a fair set."""
        return self._k("fair:who")

    def consumer_info(self, consumer: str) -> str:
        return self._k(f"consumer:{consumer}")

    @property
    def failures(self) -> str:
        return self._k("failures")

    def result(self, request_id: str) -> str:
        return self._k(f"result:{request_id}")

    def attempts(self, request_id: str) -> str:
        """A retried request's failed runs (complete.lua's 'retry')."""
        return self._k(f"attempts:{request_id}")

    def stream(self, request_id: str) -> str:
        return self._k(f"stream:{request_id}")

    def inbox(self, producer: str) -> str:
        return self._k(f"inbox:{producer}")

    def idempotency(self, key: str) -> str:
        return self._k(f"idem:{key}")


def bulk_state_key(job_id: str) -> str:
    return f"batchgate:bulk:{job_id}"


def bulk_lease_key(job_id: str) -> str:
    return f"batchgate:bulk:{job_id}:lease"
