"""`batchgate plan`: the cheapest policy and consumer count meeting a P99 target, its JSON,
the infeasible answer, --seed, --apply and --queue against a real Redis."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from batchgate.cli import main
from scheduler_core.admin import read_policy
from scheduler_core.cost_model import CostModel, write_cost_model
from scheduler_core.keys import QueueKeys
from scheduler_core.ops.planner import Costs, Load, Target, consumers_for
from scheduler_core.ops.simulation import ModelTime
from scheduler_core.policy import Policy, Strategy


def plan(*args: str) -> dict:
    result = CliRunner().invoke(main, ["plan", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_a_feasible_answer_meets_the_target_with_the_fewest_consumers():
    out = plan("--rate", "2000", "--slo-p99-ms", "100", "--cost-ms", "5+0.5*b")
    assert out["feasible"] is True
    assert set(out) >= {"feasible", "consumers", "policy", "predicted", "runners_up"}
    assert set(out["policy"]) == {"strategy", "max_batch_size", "max_queue_delay_ms"}
    predicted = out["predicted"]
    assert set(predicted) >= {"throughput_rps", "mean_batch", "utilisation", "latency_ms"}
    assert set(predicted["latency_ms"]) == {"all", "high", "normal", "low"}
    assert set(predicted["latency_ms"]["all"]) == {"p50", "p95", "p99", "max"}
    assert predicted["latency_ms"]["all"]["p99"] <= 100
    # One consumer cannot carry 2,000 req/s at all: a full batch of b takes 5 + 0.5·b ms,
    # so it serves under 2,000/s for any b. Two can (batches of 16 and more).
    assert out["consumers"] == 2
    for runner in out["runners_up"]:
        assert runner["consumers"] == out["consumers"]
        assert runner["predicted"]["latency_ms"]["all"]["p99"] <= 100
        assert runner["headroom"] <= out["headroom"]


def test_the_policy_found_meets_the_target_when_simulated_on_its_own():
    out = plan("--rate", "300", "--slo-p99-ms", "40", "--cost-ms", "5+0.5*b", "--mix",
               "normal=1")
    policy = Policy.build(**out["policy"])
    check = consumers_for(policy, Load(300, (0, 1, 0), requests=5000, seed=7), Target(40),
                          Costs(ModelTime(5, 0.5)))
    assert check.feasible and check.best is not None
    assert check.best.consumers <= out["consumers"]


def test_no_configuration_meets_a_target_below_the_model_time():
    # t(1) = 5.5 ms: no policy answers within 3 ms; the closest is said, with its count.
    out = plan("--rate", "100", "--slo-p99-ms", "3", "--cost-ms", "5+0.5*b",
               "--max-consumers", "4")
    assert out["feasible"] is False
    assert out["closest_slo_p99_ms"] >= 5.5 + 1.22  # model time plus transport
    assert out["closest_slo_p99_ms"] >= out["predicted"]["latency_ms"]["all"]["p99"]
    assert 1 <= out["consumers"] <= 4
    assert out["policy"] is not None


def test_a_load_beyond_max_consumers_is_infeasible_and_says_how_many_it_would_take():
    # 20,000 req/s of t(b) = 5 + 0.5·b: at most 64/37 ms per consumer = 1,730 req/s.
    out = plan("--rate", "20000", "--slo-p99-ms", "1000", "--cost-ms", "5+0.5*b",
               "--max-consumers", "4", "--requests", "500")
    assert out["feasible"] is False
    assert out["consumers"] > 4


def test_the_same_seed_gives_the_same_answer():
    args = ("--rate", "800", "--slo-p99-ms", "60", "--cost-ms", "2+0.3*b", "--seed", "5")
    first, second = plan(*args), plan(*args)
    first.pop("wall_s"), second.pop("wall_s")
    for out in (first, second):
        for option in [out, *out["runners_up"]]:
            option["predicted"].pop("wall_s")
    assert first == second


@pytest.mark.parametrize(("args", "field"), [
    (["--rate", "0", "--slo-p99-ms", "50", "--cost-ms", "5"], "rate"),
    (["--rate", "10", "--slo-p99-ms", "-1", "--cost-ms", "5"], "slo_p99_ms"),
    (["--rate", "10", "--slo-p99-ms", "50", "--cost-ms", "x"], "cost_ms"),
    (["--rate", "10", "--slo-p99-ms", "50"], "queue"),
    (["--rate", "10", "--slo-p99-ms", "50", "--cost-ms", "5", "--apply"], "queue"),
    (["--rate", "10", "--slo-p99-ms", "50", "--cost-ms", "5", "--mix", "high=x"], "mix"),
])
def test_bad_input_names_its_field(args, field):
    result = CliRunner().invoke(main, ["plan", *args])
    assert result.exit_code == 2 and field in result.output, result.output


def test_apply_stores_the_policy_found_and_keeps_the_other_knobs(shared_redis, queue):
    client = shared_redis.client()
    from scheduler_core.admin import store_policy
    store_policy(client, queue, Policy(max_queue_size=500, aging_ms=1000), replace=True)
    out = plan("--rate", "1500", "--slo-p99-ms", "80", "--cost-ms", "4+0.25*b", "--queue",
               queue, "--redis-url", shared_redis.url, "--apply")
    assert out["feasible"] and out["applied"] is True
    stored = read_policy(client, queue)
    assert stored is not None
    assert stored.strategy is Strategy(out["policy"]["strategy"])
    assert stored.max_batch_size == out["policy"]["max_batch_size"]
    assert stored.max_queue_delay_ms == out["policy"]["max_queue_delay_ms"]
    assert (stored.max_queue_size, stored.aging_ms) == (500, 1000)


def test_apply_stores_nothing_when_no_configuration_meets_the_target(shared_redis, queue):
    out = plan("--rate", "100", "--slo-p99-ms", "2", "--cost-ms", "5", "--queue", queue,
               "--redis-url", shared_redis.url, "--apply", "--max-consumers", "2")
    assert out["feasible"] is False and out["applied"] is False
    assert read_policy(shared_redis.client(), queue) is None


def test_queue_plans_with_the_stored_cost_model(shared_redis, queue):
    client = shared_redis.client()
    missing = CliRunner().invoke(main, ["plan", "--rate", "10", "--slo-p99-ms", "50",
                                        "--queue", queue, "--redis-url", shared_redis.url])
    assert missing.exit_code == 2 and "no stored cost model" in missing.output
    write_cost_model(client, QueueKeys(queue), CostModel(5000, 500, source="profile"))
    from_queue = plan("--rate", "2000", "--slo-p99-ms", "100", "--queue", queue,
                      "--redis-url", shared_redis.url)
    given = plan("--rate", "2000", "--slo-p99-ms", "100", "--cost-ms", "5+0.5*b")
    assert from_queue["cost_ms"] == "5+0.5*b"
    assert (from_queue["consumers"], from_queue["policy"]) == (given["consumers"],
                                                               given["policy"])


def test_plan_takes_a_cost_mix_and_buckets_need_fewer_consumers():
    """The cost scenario of docs/scheduling.md at 700 req/s: a padded model, 80% cost 16 and
    20% cost 256. In one bucket short requests pay for long ones' padding; with
    --cost-buckets 32 the same target takes fewer consumers."""
    args = ("--rate", "700", "--slo-p99-ms", "100", "--mix", "normal=1", "--cost-mix",
            "16:80,256:20", "--cost-mode", "padded", "--cost-ms", "5+0.01*c")
    one, buckets = plan(*args), plan(*args, "--cost-buckets", "32")
    assert one["feasible"] and buckets["feasible"]
    assert buckets["consumers"] < one["consumers"]
    for out in (one, buckets):
        assert out["cost_mix"] == "16:80,256:20" and out["cost_ms"] == "5+0.01*c"
        assert set(out["predicted"]["latency_by_cost_ms"]) == {"16", "256"}
        assert out["predicted"]["latency_ms"]["all"]["p99"] <= 100
    assert buckets["predicted"]["padding_waste"] == 0 < one["predicted"]["padding_waste"]
    for bad, field in ((["--cost-mix", "0:5"], "cost_mix"),
                       (["--cost-buckets", "9,3"], "cost_buckets")):
        done = CliRunner().invoke(main, ["plan", "--rate", "10", "--slo-p99-ms", "50",
                                         "--cost-ms", "5", *bad])
        assert done.exit_code != 0 and field in done.output, (bad, done.output)


def test_apply_stores_the_cost_settings_planned_with(shared_redis, queue):
    client = shared_redis.client()
    from scheduler_core.admin import store_policy
    store_policy(client, queue, Policy(max_queue_size=500), replace=True)
    out = plan("--rate", "300", "--slo-p99-ms", "100", "--cost-ms", "5+0.01*c", "--cost-mix",
               "16:80,256:20", "--cost-buckets", "32", "--cost-mode", "padded", "--queue",
               queue, "--redis-url", shared_redis.url, "--apply")
    assert out["feasible"] and out["applied"] is True
    stored = read_policy(client, queue)
    assert stored is not None
    assert (stored.cost_buckets, stored.cost_mode, stored.max_queue_size) == ("32", "padded", 500)
    assert stored.max_batch_size == out["policy"]["max_batch_size"]


def test_apply_on_an_auto_queue_stores_the_fixed_delay_it_prints(shared_redis, queue):
    # Every policy change goes through admin.change_policy: a planned delay is a fixed
    # one, so an `auto` queue switches to fixed (consumers stop deriving their own).
    client = shared_redis.client()
    from scheduler_core.admin import store_policy
    store_policy(client, queue, Policy.build("dynamic", max_queue_delay_ms="auto",
                                             slo_p99_ms=80), replace=True)
    out = plan("--rate", "1500", "--slo-p99-ms", "80", "--cost-ms", "4+0.25*b", "--queue",
               queue, "--redis-url", shared_redis.url, "--apply")
    assert out["feasible"] and out["applied"] is True
    stored = read_policy(client, queue)
    assert stored is not None and stored.delay_mode == "fixed"
    assert (stored.strategy.value, stored.max_batch_size, stored.max_queue_delay_ms) == (
        out["policy"]["strategy"], out["policy"]["max_batch_size"],
        out["policy"]["max_queue_delay_ms"])


def test_apply_stores_the_cost_buckets_it_planned_with(shared_redis, queue):
    """A queue stored with cost_buckets "32": the plan simulates with them and says so
    (cost_settings; the text's first line), and --apply stores the policy planned, its
    cost settings included. Without --cost-mix every simulated request costs 1 and the
    buckets would play no part: --apply is then refused (exit 2, naming cost_mix),
    nothing written; --cost-buckets '' plans and stores none."""
    from helpers.cli import batchgate

    from scheduler_core.admin import store_policy
    client = shared_redis.client()
    store_policy(client, queue, Policy.build("dynamic", cost_buckets="32", max_queue_size=500),
                 replace=True)
    before = read_policy(client, queue)
    common = ("--rate", "300", "--slo-p99-ms", "100", "--cost-ms", "5+0.01*c", "--queue",
              queue, "--redis-url", shared_redis.url)
    refused = batchgate("plan", *common, "--apply")
    assert refused.returncode == 2 and "cost_mix" in refused.stderr + refused.stdout, refused
    assert "'32' (stored)" in refused.stderr + refused.stdout
    assert read_policy(client, queue) == before
    shown = batchgate("plan", *common, "--cost-mix", "16:80,256:20")
    assert shown.returncode == 0 and "cost_buckets 32" in shown.stdout.splitlines()[0]
    out = plan(*common, "--cost-mix", "16:80,256:20", "--apply")
    assert out["applied"] and out["cost_settings"]["cost_buckets"] == "32"
    stored = read_policy(client, queue)
    assert stored is not None
    assert (stored.cost_buckets, stored.max_batch_size, stored.max_queue_size) == (
        "32", out["policy"]["max_batch_size"], 500)
    none = plan(*common, "--cost-buckets", "", "--apply")
    assert none["applied"] and none["cost_settings"]["cost_buckets"] == ""
    stored = read_policy(client, queue)
    assert stored is not None and stored.cost_buckets == ""
    assert stored.max_batch_size == none["policy"]["max_batch_size"]
