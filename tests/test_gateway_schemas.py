"""The gateway reads submit bodies with `schemas.check_submit` (the producer library's
checks), while its OpenAPI spec comes from the pydantic model `SubmitRequest`. A
differential test holds the two together: whatever the model accepts, the gateway accepts
with the same values (or refuses for the payload only, for limits JSON Schema cannot
state: 64 bits, 64 levels); whatever the model refuses, the gateway refuses, naming one of
the fields the model names."""

from __future__ import annotations

import math

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("pydantic")
from pydantic import ValidationError  # noqa: E402

from producer.gateway.schemas import (  # noqa: E402
    SUBMIT_FIELDS,
    SubmitRequest,
    check_submit,
    parse_submit,
)
from producer.validation import MAX_DEADLINE_MS  # noqa: E402
from scheduler_core.errors import InvalidRequest  # noqa: E402
from scheduler_core.policy import Priority  # noqa: E402
from scheduler_core.wire import DEFAULT_MAX_PAYLOAD_BYTES  # noqa: E402

ANYTHING = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(),
                     st.text(max_size=5), st.lists(st.integers(), max_size=2))


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


PAYLOADS = st.one_of(
    st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats()
                 | st.text(max_size=8),
                 lambda inner: st.lists(inner, max_size=3)
                 | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=8),
    st.integers(60, 70).map(nested))
FIELDS = {
    "payload": PAYLOADS,
    "priority": st.one_of(st.sampled_from(["high", "normal", "low", "HIGH", " low", "urgent",
                                           "1", 0, 1, 2, 3, -1, 1.0, 2.0, 1.5, True, False,
                                           None, 2**70]), ANYTHING),
    "deadline_ms": st.one_of(st.integers(-2, 3), st.integers(MAX_DEADLINE_MS - 1,
                                                             MAX_DEADLINE_MS + 1),
                             st.sampled_from([None, 1.0, 1.5, 2000.0, True, "5", math.inf,
                                              math.nan, 2**70]), ANYTHING),
    "idempotency_key": st.one_of(st.from_regex(r"[A-Za-z0-9_.:-]{1,8}", fullmatch=True),
                                 st.sampled_from(["", "has space", "a\n", "x" * 200,
                                                  "x" * 201, None, 7]), ANYTHING),
    "tenant": st.one_of(st.from_regex(r"[A-Za-z0-9_.:-]{1,8}", fullmatch=True),
                        st.sampled_from(["", "a b", "a\n", "x" * 64, "x" * 65, "{q}", None,
                                         7]), ANYTHING),
    "wait": st.one_of(st.booleans(), ANYTHING),
    "stream": st.one_of(st.booleans(), ANYTHING),
    "timeout_s": st.one_of(st.floats(-1, 301), st.integers(-1, 301),
                           st.sampled_from([0, 300, 300.0001, None, True, "5", math.inf,
                                            math.nan]), ANYTHING),
}
BODIES = st.one_of(
    st.fixed_dictionaries({}, optional={**FIELDS, "deadline": ANYTHING, "extra": ANYTHING}),
    st.fixed_dictionaries({"payload": PAYLOADS},  # mostly valid
                          optional={k: v for k, v in FIELDS.items() if k != "payload"}),
    ANYTHING)


@settings(max_examples=3000, deadline=None)
@given(BODIES)
def test_the_gateway_reads_a_body_as_its_spec_describes_it(body):
    try:
        model = SubmitRequest.model_validate(body)
        refused = None
    except ValidationError as exc:
        model = None
        refused = {str(error["loc"][0]) if error["loc"] else "body" for error in exc.errors()}
    try:
        submit = check_submit(body, DEFAULT_MAX_PAYLOAD_BYTES)
        error = None
    except InvalidRequest as exc:
        submit, error = None, exc
    if refused is not None:
        assert error is not None, (body, refused)
        assert error.field in refused, (body, refused, error)
        assert str(error).startswith(f"{error.field}: ")
        return
    assert model is not None
    if error is not None:  # beyond what JSON Schema can say: the payload's path is named
        assert error.field.startswith("payload"), (body, error)
        return
    assert submit is not None
    assert submit.priority == Priority.parse(model.priority)
    assert submit.deadline_ms == model.deadline_ms
    assert submit.idempotency_key == model.idempotency_key
    assert submit.wait is model.wait
    assert submit.stream is model.stream
    assert submit.timeout_s == model.timeout_s
    assert submit.tenant == model.tenant
    assert orjson.loads(submit.payload.data) == model.payload


def test_fields_and_messages():
    assert SUBMIT_FIELDS == ("payload", "priority", "deadline_ms", "idempotency_key", "cost",
                             "tenant", "wait", "stream", "timeout_s")
    cases = [
        (b'{"payload": ', "body", "body: JSON decode error"),
        (b"\xff\xfe{", "body", "body: There was an error parsing the body"),
        (b"[1]", "body", "body: must be a JSON object, got list"),
        (b'{"priority": "high"}', "payload", "payload: required"),
        (b'{"payload": 1, "priority": "HIGH"}', "priority",
         "priority: 'HIGH' is not a priority; use \"high\", \"normal\", \"low\" or 0, 1, 2"),
        (b'{"payload": 1, "deadline_ms": 0}', "deadline_ms",
         f"deadline_ms: 0 is outside [1, {MAX_DEADLINE_MS}]"),
        (b'{"payload": 1, "deadline_ms": 1.5}', "deadline_ms",
         "deadline_ms: must be a whole number of milliseconds"),
        (b'{"payload": 1, "timeout_s": 301}', "timeout_s", "timeout_s: must be a number"),
        (b'{"payload": 1, "wait": "yes"}', "wait", "wait: must be true or false"),
        (b'{"payload": 1, "stream": 1}', "stream", "stream: must be true or false"),
        (b'{"payload": 1, "cost": 0}', "cost", "cost: 0 is outside [1, 1000000000]"),
        (b'{"payload": 1, "cost": "5"}', "cost", "cost: must be a whole number"),
        (b'{"payload": 1, "deadline": 5}', "deadline", "deadline: Extra inputs"),
        (b'{"payload": {"n": [1, 123456789012345678901]}}', "payload.n[1]",
         "payload.n[1]: integer 123456789012345678901 does not fit in 64 bits"),
        (b'{"payload": [NaN]}', "payload[0]", "payload[0]: nan is not valid JSON"),
    ]
    for data, field, message in cases:
        with pytest.raises(InvalidRequest) as raised:
            parse_submit(data, DEFAULT_MAX_PAYLOAD_BYTES)
        assert raised.value.field == field, (data, raised.value)
        assert str(raised.value).startswith(message), (data, str(raised.value))
    submit = parse_submit(b'{"payload": {"x": [1, 2.5, null, "\\u00e9"]}, "priority": 2.0, '
                          b'"deadline_ms": 2000.0, "wait": true, "timeout_s": 5}',
                          DEFAULT_MAX_PAYLOAD_BYTES)
    assert orjson.loads(submit.payload.data) == {"x": [1, 2.5, None, "é"]}
    assert (submit.priority, submit.deadline_ms, submit.wait, submit.timeout_s) == \
        (Priority.LOW, 2000, True, 5.0)
