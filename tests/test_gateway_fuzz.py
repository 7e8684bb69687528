"""Fuzz `batchgate gateway` from its own OpenAPI spec with schemathesis: a real gateway
process (with a bearer token) and a real consumer; every answer must match the spec
(status codes, content types, bodies, headers) and valid/invalid input must be
accepted/rejected. Bounded: 15 examples per operation (BATCHGATE_FUZZ_EXAMPLES=500 for a
deeper run)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, Phase, settings

# The gateway extra and schemathesis: skipped, like the other extras' tests, where absent.
pytest.importorskip("httpx")
pytest.importorskip("fastapi")
schemathesis = pytest.importorskip("schemathesis")
checks = pytest.importorskip("schemathesis.checks")
not_a_server_error = checks.not_a_server_error
positive_data_acceptance = checks.positive_data_acceptance

from helpers.processes import ConsumerProcess, free_port  # noqa: E402
from helpers.servers import ServerProcess, gateway_args  # noqa: E402

TOKEN = "fuzz-token"
EXAMPLES = int(os.environ.get("BATCHGATE_FUZZ_EXAMPLES", "15"))
# 5xx the spec documents for a request's outcome (not a gateway fault): the model failed
# on it (502), its deadline passed before it ran (504)
OUTCOME_STATUSES = {502: "failed", 504: "expired"}


@pytest.fixture(scope="module")
def fuzzed_gateway(shared_redis) -> Iterator[ServerProcess]:
    queue = f"fuzz-{uuid.uuid4().hex[:8]}"
    consumer = ConsumerProcess(shared_redis.url, queue, "--model", "consumer.models:noop")
    port = free_port()
    gateway = None
    try:
        consumer.wait_ready()
        gateway = ServerProcess(gateway_args(shared_redis.url, queue, port), port,
                                env={"BATCHGATE_GATEWAY_TOKEN": TOKEN}, ready_path="/healthz")
        yield gateway
    finally:
        if gateway is not None:
            gateway.close()
        consumer.close()


@pytest.fixture(scope="module")
def gateway_schema(fuzzed_gateway: ServerProcess) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{fuzzed_gateway.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("gateway_schema")


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=list(HealthCheck))
def test_gateway_conforms_to_its_openapi_spec(case: schemathesis.Case) -> None:
    response = case.call_and_validate(
        headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30,
        excluded_checks=[not_a_server_error, positive_data_acceptance])
    if case.meta is not None and case.meta.generation.mode.is_positive:
        # Schema-valid input is accepted, except payloads beyond the limits its description
        # states and JSON Schema cannot (integers over 64 bits, nesting over 64 levels).
        if response.status_code == 422:
            assert response.json()["field"].startswith("payload"), response.text
        else:
            assert response.status_code not in range(400, 500) or \
                response.status_code in (404, 409, 410, 429), response.text
    if response.status_code >= 500:
        assert response.status_code in OUTCOME_STATUSES, response.text
        assert response.json()["status"] == OUTCOME_STATUSES[response.status_code]
