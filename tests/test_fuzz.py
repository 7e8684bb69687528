"""Fuzzing with hypothesis: the Python API, the CLI, every Lua script's arguments and
entries written into Redis by hand. Bad input gets a clear error naming the field and
writes nothing; no script fails half-way; no consumer crashes.

Examples per run (derandomized, so CI is reproducible): see EXAMPLES; BATCHGATE_FULL=1
runs 5x as many, randomly seeded.
"""

from __future__ import annotations

import math
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from click.testing import CliRunner
from helpers.processes import RedisServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchgate.cli import main as cli
from consumer.worker import Batch, ConsumerConfig, Worker
from producer import InvalidRequest, Priority, Producer
from producer.validation import check_deadline, check_idempotency_key, check_timeout
from scheduler_core.errors import InvalidPolicy
from scheduler_core.keys import QueueKeys, script_keys, validate_queue_name
from scheduler_core.policy import CHOICES, LIMITS, Policy
from scheduler_core.scripts import (
    NewRequest,
    cancel_keys,
    complete_keys,
    configure_keys,
    dead_letter_keys,
    enqueue_call,
    expire_keys,
    extend_lease_keys,
    pop_keys,
    requeue_keys,
    source,
    stream_keys,
)
from scheduler_core.wire import (
    check_json_value,
    decode_request,
    encode_error,
    encode_request,
    request_tenant,
)

FULL = os.environ.get("BATCHGATE_FULL") == "1"
LUA = Path(__file__).resolve().parent.parent / "scheduler_core" / "lua"
# (hypothesis examples, cases checked per example). Hypothesis costs a few ms per example,
# so each example carries a batch of cases: 11,840 cases per run in all.
PLAN = {
    "payload": (200, 10), "priority": (100, 10), "scalars": (100, 10), "policy": (100, 10),
    "queue": (100, 10), "consumer_config": (50, 10), "producer_config": (50, 10),
    "submit": (200, 5), "cli_submit": (100, 4), "cli_admin": (50, 4),
    "lua": (60, 5),  # per script: 10 scripts
    "hand_written": (60, 4),
}
MIN_TOTAL_CASES = 10_000
CASES: dict[str, int] = {}
# One worker runs the whole module, so that test_zz_fuzz_case_count sees every count.
pytestmark = pytest.mark.xdist_group("fuzz")


def fuzz(name: str) -> settings:
    return settings(max_examples=PLAN[name][0] * (5 if FULL else 1), deadline=None,
                    database=None, derandomize=not FULL,
                    suppress_health_check=list(HealthCheck))


def cases(name: str, strategy: st.SearchStrategy) -> st.SearchStrategy:
    """A batch of PLAN[name][1] cases for one hypothesis example."""
    size = PLAN[name][1]
    return st.lists(strategy, min_size=size, max_size=size)


def count(name: str, n: int) -> None:
    CASES[name] = CASES.get(name, 0) + n


# -- strategies -------------------------------------------------------------------------
ODD = [float("nan"), float("inf"), -float("inf"), 2**64, 2**64 - 1, -(2**63) - 1, 1j,
       b"bytes", bytearray(b"ba"), object(), {1, 2}, frozenset(), Priority.HIGH, ..., "\udcff",
       "\x00", "é", "{bg:x}", "a b", " ", "", -0.0, 1e308, 5e-324]
scalars = (st.none() | st.booleans() | st.integers() | st.floats()
           | st.text(st.characters(blacklist_categories=()), max_size=8)
           | st.binary(max_size=8) | st.sampled_from(ODD))
values = st.recursive(
    scalars,
    lambda inner: (st.lists(inner, max_size=4) | st.tuples(inner, inner)
                   | st.dictionaries(st.text(max_size=4) | st.integers() | st.none()
                                     | st.binary(max_size=2), inner, max_size=4)),
    max_leaves=12)


def nest(depth: int) -> Any:
    value: Any = 0
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


LIMIT = 1024  # max_payload_bytes in these tests: payloads of about that size
payloads = values | st.integers(0, 90).map(nest) | st.integers(LIMIT - 6, LIMIT + 2).map(
    lambda n: "x" * n)
TOKENS = ["", " ", "0", "1", "-1", "2", "3", "1.5", "-0", "nan", "NaN", "inf", "-inf",
          "Infinity", "1e3", "1e400", "0x10", " 1", "1 ", "+1", "99999999999999999999",
          "4097", "10001", "100", "99", "86400001", "abc", "|", ",", ":", "{", "}", "\x00",
          "é", "ok", "err", "dead", "expired", "retry", "purge", "ensure", "replace",
          "strategy", "fifo", "max_batch_size", "cancelled"]
tokens = (st.sampled_from(TOKENS) | st.binary(max_size=6) | st.integers(-2**70, 2**70)
          | st.floats() | st.text(max_size=6))


def normalise(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [normalise(v) for v in value]
    if isinstance(value, dict):
        return {k: normalise(v) for k, v in value.items()}
    return value


def as_json_text(value: Any) -> str:
    """A value as a user might type it on the command line (not always valid JSON)."""
    try:
        return orjson.dumps(value, default=str).decode()
    except TypeError:
        return repr(value)


def field_of(exc: InvalidRequest) -> str:
    return re.split(r"[.\[]", exc.field, maxsplit=1)[0]


# -- pure validation (no Redis) -------------------------------------------------------------
@fuzz("payload")
@given(batch=cases("payload", st.tuples(payloads, st.sampled_from([16, LIMIT]))))
def test_fuzz_payload_encoding(batch):
    """Encoding refuses exactly what the rules refuse (check_json_value's walk, which the
    encoder skips for values whose JSON reads back as themselves), and keeps the rest."""
    count("payload", len(batch))
    for payload, limit in batch:
        try:
            check_json_value(payload, "payload")
            walked: bytes | None = orjson.dumps(payload)
        except (InvalidRequest, orjson.JSONEncodeError):
            walked = None
        try:
            data = encode_request(payload, limit)
        except InvalidRequest as exc:
            assert field_of(exc) == "payload"
            assert walked is None or len(walked) > limit, (payload, exc)
            continue
        assert data == b'{"v":1,"payload":%s}' % walked
        assert len(data) <= limit + 32  # the envelope's own bytes
        assert decode_request(data) == normalise(payload)


# -- what the docs document, written out independently of the code ----------------------
def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def in_range(value: Any, low: int, high: int) -> bool:
    return is_int(value) and low <= value <= high


def charset(value: Any, most: int) -> bool:
    """1-`most` characters from letters, digits, '_', '.', ':' and '-'."""
    return isinstance(value, str) and re.fullmatch(rf"[A-Za-z0-9_.:-]{{1,{most}}}",
                                                   value) is not None


def expected_priority(value: Any) -> Priority | None:
    """Priority.HIGH/NORMAL/LOW, a name in any case (spaces around ignored), or 0-2."""
    if isinstance(value, Priority):
        return value
    if isinstance(value, str):
        return {"HIGH": Priority.HIGH, "NORMAL": Priority.NORMAL,
                "LOW": Priority.LOW}.get(value.strip().upper())
    return Priority(value) if in_range(value, 0, 2) else None


SCALAR_OK = {  # deadline_ms: 1-86400000 ms; timeout: seconds >= 0; key: 1-200 of the set
    "deadline_ms": lambda v: v is None or (is_number(v) and 1 <= v <= 86_400_000),
    "timeout": lambda v: v is None or (is_number(v) and v >= 0),
    "idempotency_key": lambda v: v is None or charset(v, 200),
}


@fuzz("priority")
@given(batch=cases("priority", scalars | st.sampled_from(
    ["high", " Low ", "NORMAL", 0, 1, 2, 3, -1, True])))
def test_fuzz_priority(batch):
    count("priority", len(batch))
    for value in batch:
        try:
            parsed = Priority.parse(value)
        except InvalidRequest as exc:
            assert exc.field == "priority" and "unknown priority" in str(exc)
            assert expected_priority(value) is None, value
            continue
        assert parsed is expected_priority(value), value


@fuzz("scalars")
@given(batch=cases("scalars", st.tuples(
    st.sampled_from(["deadline_ms", "timeout", "idempotency_key"]),
    scalars | st.integers(-5, 90_000_000) | st.floats(-5, 1e9)
    | st.from_regex(r"[A-Za-z0-9_.:-]{0,210}\n?", fullmatch=True))))
def test_fuzz_scalar_arguments(batch):
    count("scalars", len(batch))
    checks = {"deadline_ms": check_deadline, "timeout": check_timeout,
              "idempotency_key": check_idempotency_key}
    for which, value in batch:
        try:
            checks[which](value)
        except InvalidRequest as exc:
            assert exc.field == which
            assert not SCALAR_OK[which](value), (which, value, exc)
            continue
        assert SCALAR_OK[which](value), (which, value)


@fuzz("policy")
@given(batch=cases("policy", st.dictionaries(
    st.sampled_from(["strategy", *LIMITS]),
    scalars | st.integers(-10, 2_000_000_000)
    | st.sampled_from(["fifo", "dynamic", "priority", "FIFO"]), max_size=4)))
def test_fuzz_policy(batch):
    count("policy", len(batch))
    for kwargs in batch:
        valid = all(in_range(v, *LIMITS[k]) if k in LIMITS else v in ("fifo", "dynamic",
                                                                       "priority")
                    for k, v in kwargs.items())
        try:
            policy = Policy(**kwargs)
        except InvalidPolicy as exc:
            assert exc.field in kwargs and not valid, (kwargs, exc)
            continue
        assert valid, kwargs
        assert Policy.from_redis(policy.to_redis()) == policy


@fuzz("queue")
@given(batch=cases("queue", scalars | st.from_regex(r"[A-Za-z0-9_.:{} -]{0,140}\n?",
                                                    fullmatch=True)))
def test_fuzz_queue_names(batch):
    count("queue", len(batch))
    for name in batch:
        try:
            validate_queue_name(name)
        except InvalidRequest as exc:
            assert exc.field == "queue" and not charset(name, 128), name
            continue
        assert charset(name, 128), name
        assert QueueKeys(name).jobs == f"{{bg:{name}}}:jobs"
        assert not set("{} ") & set(name)


@fuzz("consumer_config")
@given(batch=cases("consumer_config", st.tuples(
    scalars | st.integers(-1, 90_000_000), scalars | st.integers(-1, 10**8),
    scalars | st.integers(-1, 600_000_000), st.text(max_size=6) | st.just("a|b"))))
def test_fuzz_consumer_config(batch):
    count("consumer_config", len(batch))
    for lease_ms, max_batch_ms, max_result_bytes, name in batch:
        wrong = {field for field, ok in (
            ("lease_ms", in_range(lease_ms, 100, 86_400_000)),
            ("max_batch_ms", max_batch_ms == 0 and is_int(max_batch_ms)
             or in_range(max_batch_ms, 100, 86_400_000)),
            ("max_result_bytes", in_range(max_result_bytes, 16, 512 << 20)),
            ("name", "|" not in name)) if not ok}
        try:
            ConsumerConfig(lease_ms=lease_ms, max_batch_ms=max_batch_ms,
                           max_result_bytes=max_result_bytes, name=name)
        except InvalidRequest as exc:
            assert exc.field in wrong, (exc, wrong)
            continue
        assert not wrong, (lease_ms, max_batch_ms, max_result_bytes, name)


class FakeScript:
    def __init__(self, calls: list):
        self.calls = calls
        self.sha = "0" * 40

    def __call__(self, keys=None, args=None, client=None):
        if client is not None:  # the listener expiring requests: each reply "finished"
            client.queued += 1
            return client
        if args and args[0] in ("list", "expire"):  # the deadline timer: nothing is due
            return [0, -1, 0]
        self.calls.append((keys, args))
        ids = args[3::7]  # then each one's deadline, as enqueue.lua answers
        return [1, len(ids), len(ids), *(i.encode() for i in ids), *args[5::7]]


class FakePipeline:
    def __init__(self):
        self.queued = 0

    def execute(self, raise_on_error=True):
        return [0] * self.queued

    def __getattr__(self, name):
        return lambda *a, **k: []


class NoRedis:
    """Stands in for Redis: records script calls, answers enqueue as if accepted."""

    def __init__(self):
        self.calls: list = []

    def register_script(self, _source):
        return FakeScript(self.calls)

    def blmpop(self, *args, **kwargs):
        time.sleep(0.05)

    def pipeline(self, *args, **kwargs):
        return FakePipeline()

    def get(self, key):
        return None

    def set(self, *args, **kwargs):  # the queue's mark, after an accepted enqueue
        return True

    def info(self, section=None):
        return {"redis_version": "7.2.0"}  # passes the producer's version check

    def mget(self, keys):
        return [None] * len(keys)

    def close(self):
        pass


@fuzz("producer_config")
@given(batch=cases("producer_config", st.tuples(
    scalars | st.sampled_from(["ok-queue", "ok-queue\n", "q" * 128, "q" * 129]),
    scalars | st.integers(-1, 10**9),
    scalars | st.integers(-1, 10**8))))
def test_fuzz_producer_constructor(batch):
    count("producer_config", len(batch))
    for queue, max_payload_bytes, idempotency_ttl_s in batch:
        wrong = {field for field, ok in (
            ("queue", charset(queue, 128)),
            ("max_payload_bytes", max_payload_bytes is None
             or in_range(max_payload_bytes, 16, 512 << 20)),
            ("idempotency_ttl_s", idempotency_ttl_s is None
             or in_range(idempotency_ttl_s, 1, 30 * 86_400))) if not ok}
        try:
            Producer(queue=queue, max_payload_bytes=max_payload_bytes,
                     idempotency_ttl_s=idempotency_ttl_s, client=NoRedis()).close()
        except InvalidRequest as exc:
            assert exc.field in wrong, (exc, wrong)
            continue
        assert not wrong, (queue, max_payload_bytes, idempotency_ttl_s)


def test_fuzz_producer_submit():
    fake = NoRedis()
    producer = Producer(queue="fuzz", client=fake, max_payload_bytes=LIMIT)
    fields = {"payload", "payloads", "priority", "deadline_ms", "idempotency_key", "cost",
              "store_result", "tenant"}
    case = st.tuples(
        st.booleans(), payloads, st.lists(scalars, max_size=3),
        st.sampled_from(["high", "low", 0, 2, "urgent", 5, None, 1.0]) | scalars,
        st.none() | st.integers(-1, 90_000_000) | scalars,
        st.none() | st.from_regex(r"[a-z{} :-]{0,12}", fullmatch=True) | scalars,
        st.integers(-1, 10**9 + 1) | st.lists(st.integers(0, 3), max_size=4) | scalars,
        st.booleans() | st.sampled_from([None, 0, 1, "yes"]),
        st.none() | st.from_regex(r"[a-z{} :-]{0,12}", fullmatch=True)
        | st.sampled_from(["default", "x" * 64, "x" * 65]) | scalars)

    def check_one(many, payload, more, priority, deadline_ms, key, cost, store, tenant):
        fake.calls.clear()
        try:
            if many:
                batch = [payload, *more]
                handles = producer.submit_many(batch, priority=priority,
                                               deadline_ms=deadline_ms,
                                               idempotency_keys=[key] * len(batch), cost=cost,
                                               store_result=store, tenant=tenant)
            else:
                batch = [payload]
                handles = [producer.submit(payload, priority=priority,
                                           deadline_ms=deadline_ms, idempotency_key=key,
                                           cost=cost, store_result=store, tenant=tenant)]
        except InvalidRequest as exc:
            assert field_of(exc) in fields, exc
            assert not fake.calls, "bad input reached Redis"
            return
        [(keys, args)] = fake.calls
        assert args[1] == len(batch) == len(handles) and isinstance(args[2], int)
        for i, value in enumerate(batch):
            rid, prio, deadline, envelope, flag, c, keep = args[3 + 7 * i: 10 + 7 * i]
            assert re.fullmatch(r"[0-9a-f]{32}", rid) and prio in (0, 1, 2)
            assert isinstance(deadline, int) and 0 <= deadline <= 86_400_000
            assert decode_request(envelope) == normalise(value) and flag in (0, 1)
            assert type(c) is int and 1 <= c <= 10**9
            assert c == (cost[i] if isinstance(cost, list) else cost)
            assert store in (True, False) and keep == int(store or flag)
            assert request_tenant(envelope) == (tenant or "default")
        assert len(keys) == len(script_keys("enqueue")) + sum(args[7::7])

    @fuzz("submit")
    @given(batch=cases("submit", case))
    def check(batch):
        count("submit", len(batch))
        for one in batch:
            check_one(*one)

    try:
        check()
    finally:
        producer.close()


# -- the CLI ----------------------------------------------------------------------------
def stored_keys(r: redis.Redis) -> set[bytes]:
    """Every key but the producers' inboxes, which a closing producer may leave to expire
    (its listener's wake-up item) whether or not its last submit wrote anything."""
    return {k for k in r.scan_iter(count=1000) if b":inbox:" not in k}


def test_fuzz_cli_submit(redis_server):
    """On a server of its own: no other test's keys come and go during a comparison."""
    runner, r = CliRunner(), redis_server.client()
    prefix = f"fz{uuid.uuid4().hex[:6]}-"
    case = st.tuples(
        st.text(max_size=20) | values.map(as_json_text),
        st.from_regex(r"[a-z0-9{} .:|-]{0,10}", fullmatch=True),
        st.sampled_from(["high", "normal", "low", "HIGH", "urgent", "", "0"]),
        st.none() | st.integers(-10, 10**9).map(str) | st.sampled_from(["abc", "1.5", "nan", ""]),
        st.none() | st.from_regex(r"[a-z {}:]{0,8}", fullmatch=True))

    def check_one(payload, queue, priority, deadline, key):
        args = ["submit", "--redis-url", redis_server.url, "--queue", prefix + queue,
                "--priority", priority]
        args += ["--deadline-ms", deadline] if deadline is not None else []
        args += ["--idempotency-key", key] if key is not None else []
        before = stored_keys(r)
        result = runner.invoke(cli, [*args, "--", payload])
        assert result.exception is None or isinstance(result.exception, SystemExit), (
            args, payload, result.output, result.exception)
        if result.exit_code == 0:
            assert re.fullmatch(r"[0-9a-f]{32}\n", result.output)
        else:
            assert result.exit_code == 2 and "Error" in result.output, result.output
            assert stored_keys(r) == before

    @fuzz("cli_submit")
    @given(batch=cases("cli_submit", case))
    def check(batch):
        count("cli_submit", len(batch))
        for one in batch:
            check_one(*one)

    check()


def test_fuzz_cli_admin(shared_redis):
    runner, r = CliRunner(), shared_redis.client()
    queue = f"fz-admin-{uuid.uuid4().hex[:6]}"
    base = ["--redis-url", shared_redis.url, "--queue", queue]
    assert runner.invoke(cli, ["policy", "set", *base, "--strategy", "fifo"]).exit_code == 0
    numbers = st.integers(-5, 2_000_000_000).map(str) | st.sampled_from(
        ["", "x", "1.5", "nan", "1e3", "-0", "99999999999999999999"])
    case = st.tuples(st.sampled_from([f"--{name.replace('_', '-')}" for name in LIMITS]),
                     numbers, st.sampled_from([None, "fifo", "dynamic", "bogus"]), numbers)

    def check_one(option, value, strategy, limit):
        stored = r.hgetall(QueueKeys(queue).policy)
        args = ["policy", "set", *base, option, value]
        args += ["--strategy", strategy] if strategy else []
        result = runner.invoke(cli, args)
        assert result.exception is None or isinstance(result.exception, SystemExit)
        assert result.exit_code in (0, 2), result.output
        if result.exit_code:
            assert r.hgetall(QueueKeys(queue).policy) == stored
        listed = runner.invoke(cli, ["dead-letter", "list", *base, "--limit", limit])
        assert listed.exit_code in (0, 2) and (listed.exception is None
                                               or isinstance(listed.exception, SystemExit))

    @fuzz("cli_admin")
    @given(batch=cases("cli_admin", case))
    def check(batch):
        count("cli_admin", len(batch))
        for one in batch:
            check_one(*one)

    check()


# -- every Lua script, called directly with garbage -----------------------------------------
@pytest.fixture(scope="module")
def debug_redis():
    server = RedisServer("--enable-debug-command", "yes")
    yield server
    server.close()


Q = QueueKeys("fz")
ENV = encode_request(1)
RESULT = b'{"v":1,"id":"f1","ok":true,"value":1}'


def setup_state(r: redis.Redis) -> None:
    """A small queue in every state: waiting, in flight (batch 7), dead-lettered."""
    pipe = r.pipeline(transaction=False)
    pipe.flushdb()
    pipe.hset(Q.policy, mapping=Policy.build("dynamic", max_batch_size=4, max_queue_size=10,
                                             result_ttl_s=60).to_redis())
    pipe.zadd(Q.pending(1), {"r1": 1000, "r2": 2000})
    pipe.zadd(Q.pending(0), {"r3": 3000})
    pipe.zadd(Q.deadlines, {"r2": 9e15})  # r2 has a deadline, not yet passed
    meta = {"r1": "1:1000:0:0:0:prod", "r2": "1:2000:9000000000000000:0:0:prod",
            "r3": "0:3000:0:0:1:prod", "f1": "1:500:0:1:0:prod", "d1": "1:100:0:4:0:prod"}
    pipe.hset(Q.jobs, mapping={k: m.encode() + b"|" + ENV for k, m in meta.items()})
    pipe.hset(Q.owner, "f1", "7")
    pipe.zadd(Q.inflight, {"7": 9e15})
    pipe.hset(Q.batches, "7", "c1|f1")
    pipe.set(Q.seq, 7)
    pipe.set(Q.clock, 3000)
    pipe.zadd(Q.dead, {"d1": 1})
    pipe.hset(Q.dead_reason, "d1", encode_error("d1", "DeadLettered", "x"))
    pipe.execute()


TEMPLATES = {  # a valid call of each script against setup_state: (KEYS, ARGV)
    "enqueue": (enqueue_call(Q, "prod", [NewRequest("n1", 1, 0, ENV, "k1")], 60)[0],
                ["prod", 1, 60, "n1", 1, 0, ENV, 1, 1, 0]),
    "pop_batch": (pop_keys(Q), ["c1", 1000]),
    "complete": (complete_keys(Q, [("f1", "prod")]), ["7", 60, 1, "f1", "ok", RESULT,
                                                       "1:1500"]),
    "extend_lease": (extend_lease_keys(Q), ["c1", "7", 1000]),
    "requeue_expired": (requeue_keys(Q), [10]),
    "configure": (configure_keys(Q), ["replace", *(x for kv in Policy().to_redis().items()
                                            for x in kv)]),
    "cancel": (cancel_keys(Q, "r1", "prod"), ["r1", 60, encode_error("r1", "Cancelled", "x"),
                                              "cancelled"]),
    "dead_letter": (dead_letter_keys(Q, ["d1"]), ["retry", 1, "d1"]),
    "expire_due": (expire_keys(Q, [("r2", "prod")]), ["expire", 60, 1, "r2",
                                                      encode_error("r2", "DeadlineExceeded",
                                                                   "x")]),
    "stream_append": (stream_keys(Q, ["f1", "f1"]), ["7", 60, 100, 2, "f1", "r", 2, "f1", "p",
                                                     b'{"t":1}']),
}
ERROR_FIELDS = {m for path in LUA.glob("*.lua")
                for m in re.findall(r"\{-3, '(\w+)'\}", path.read_text())} | {
    "strategy", "cost_buckets", *CHOICES, *LIMITS}
META = re.compile(rb"[0-2]:\d{1,17}:\d{1,17}:\d{1,9}:[01]:[A-Za-z0-9_.-]{0,128}"
                  rb"(:\d{1,10}){0,2}\|")


def check_invariants(r: redis.Redis) -> None:
    for rid, job in r.hgetall(Q.jobs).items():
        assert META.match(job), (rid, job)
    for key in [*Q.pending_all, Q.inflight, Q.dead, Q.consumers]:
        assert all(math.isfinite(score) for _, score in r.zrange(key, 0, -1, withscores=True))
    for rid, batch in r.hgetall(Q.owner).items():
        assert r.zscore(Q.inflight, batch) is not None, (rid, batch)
    Policy.from_redis(r.hgetall(Q.policy))


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_fuzz_lua_script_arguments(debug_redis, name):
    r = debug_redis.client()
    script = r.register_script(source(name))
    keys, template = TEMPLATES[name]
    setup_state(r)
    assert script(keys=keys, args=template) is not None  # the template itself is valid
    case = st.tuples(st.lists(st.tuples(st.integers(0, len(template) - 1), tokens),
                              max_size=3), st.integers(0, 3), st.lists(tokens, max_size=2))

    def check_one(edits, cut, extra):
        args = list(template)
        for position, token in edits:
            args[position] = token
        args = args[:len(args) - cut] if cut < 3 else args
        args += extra
        setup_state(r)
        before = r.execute_command("DEBUG", "DIGEST")
        try:
            reply = script(keys=keys, args=args)
        except redis.ResponseError as exc:
            raise AssertionError(f"{name}.lua failed on ARGV {args!r}: {exc}") from None
        if isinstance(reply, list) and reply and isinstance(reply[0], int) and reply[0] < 0:
            if reply[0] == -3:
                assert reply[1].decode() in ERROR_FIELDS, reply
            assert r.execute_command("DEBUG", "DIGEST") == before, (args, reply)
        check_invariants(r)

    @fuzz("lua")
    @given(batch=cases("lua", case))
    def check(batch):
        count(f"lua:{name}", len(batch))
        for one in batch:
            check_one(*one)

    check()


def test_configure_limits_match_policy_limits():
    text = source("configure")  # as loaded: LIMITS rendered from scheduler_core.policy
    lua = {name: (int(lo), int(hi)) for name, lo, hi in
           re.findall(r"(\w+) = \{(\d+), (\d+)\}", text)}
    assert lua == LIMITS


# -- entries written into Redis by hand ---------------------------------------------------
def test_fuzz_hand_written_entries_are_dead_lettered_not_fatal(debug_redis):
    """Garbage members, meta and envelopes written straight into a queue, a few at a time
    beside one real request: the consumer dead-letters (or, if by chance valid, runs) each,
    never crashes, and keeps serving."""
    r = debug_redis.client()
    consumer = Worker(lambda payloads: payloads, ConsumerConfig(
        redis_url=debug_redis.url, queue="fz", policy={"strategy": "fifo",
                                                       "max_batch_size": 4}))
    junk = st.none() | st.binary(max_size=12) | st.sampled_from(
        [b"1:1:0:0:0:", b"9:1:0:0:0:p", b"1:" + b"9" * 400 + b":0:0:0:p",
         b"2:5:5:99999:1:\xff", b"0:1:0:1:0:p", b"1:1:0:0:2:p", b"1:1:0:0:1:p:|",
         b'{"v":1,"payload":1}', b'{"v":1}', b"\x00",
         b'{"v":1,"payload":' + b"[" * 2000 + b"]" * 2000 + b"}"])
    entry = st.tuples(
        st.binary(min_size=0, max_size=10) | st.from_regex(r"[a-z0-9]{1,8}", fullmatch=True),
        st.integers(0, 2), st.floats(allow_nan=False) | st.integers(-2**60, 2**60), junk, junk)

    @fuzz("hand_written")
    @given(batch=cases("hand_written", entry))
    def check(batch):
        count("hand_written", len(batch))
        r.flushdb()
        consumer.prepare()
        pipe = r.pipeline(transaction=False)
        ids = {}
        for rid, level, score, meta, envelope in batch:
            ids[rid] = True
            pipe.zadd(Q.pending(level), {rid: score})
            if meta is not None or envelope is not None:  # one jobs value, "meta|envelope"
                pipe.hset(Q.jobs, rid, b"|".join(x for x in (meta, envelope) if x is not None))
        pipe.execute()
        with Producer(debug_redis.url, "fz", client=r) as p:
            handle = p.submit({"ok": 1}, store_result=True)
            outcome: Any = consumer._pop()
            for _ in range(20):
                if isinstance(outcome, Batch):
                    outcome = consumer._process(outcome)
                elif sum(r.zcard(k) for k in Q.pending_all) == 0:
                    break
                else:
                    outcome = consumer._pop()
            assert sum(r.zcard(k) for k in Q.pending_all) == 0
            assert r.zcard(Q.inflight) == 0
            assert p.fetch(handle.id).value == {"ok": 1}  # the queue kept serving
        for rid in ids:  # each ran (it happened to be valid) or is dead-lettered
            name = rid.decode() if isinstance(rid, bytes) and rid.isascii() else str(rid)
            assert r.exists(Q.result(name)) or r.zscore(Q.dead, rid) is not None, rid

    check()


def test_zz_fuzz_case_count():
    """Runs last in this module: with every fuzz test above run, >= 10,000 cases."""
    expected = {*PLAN} - {"lua"} | {f"lua:{name}" for name in TEMPLATES}
    if set(CASES) != expected:
        pytest.skip("only part of the fuzz tests ran")
    total = sum(CASES.values())
    print(f"\nfuzz: {total} cases: {CASES}")
    assert total >= MIN_TOTAL_CASES
