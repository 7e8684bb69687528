"""`batchgate plan`: the cheapest policy and consumer count that meet a P99 target at a
load, found with the simulator (scheduler_core.ops.planner does the search)."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import click
import orjson

from batchgate.simulate import CostModel, _policy_option, parse_cost_mix, parse_mix
from scheduler_core.compat import connect_checked
from scheduler_core.cost_model import read_cost_model
from scheduler_core.errors import InvalidRequest
from scheduler_core.keys import QueueKeys
from scheduler_core.ops.continuous_sim import StepTime
from scheduler_core.ops.options import redis_url_option
from scheduler_core.ops.planner import (
    DEFAULT_REQUESTS,
    Costs,
    Load,
    Option,
    Plan,
    Target,
    better,
    plan,
)
from scheduler_core.ops.simulation import (
    BATCHING,
    DEFAULT_OVERHEAD_MS,
    DEFAULT_TRANSPORT_MS,
    mean_cost,
)
from scheduler_core.policy import Policy

# The cost settings a plan takes as given (stored for --queue, or the flags): not searched.
COST_SETTINGS = ("max_cost", "over_cost", "max_batch_cost", "cost_mode", "cost_buckets")


def _policy_line(option: Option) -> str:
    p = option.policy
    if p.strategy.value == "fifo":
        return f"fifo, max_batch_size {p.max_batch_size}"
    return f"{p.strategy}, max_batch_size {p.max_batch_size}, max_queue_delay_ms " \
           f"{p.max_queue_delay_ms}"


def _p99(option: Option, level: str) -> str:
    value = option.result.latency_ms[level]["p99"]
    return "-" if value is None else f"{value:.1f}"


def render(out: dict[str, Any], answer: Plan, target: Target) -> str:
    goal = f"p99 <= {target.slo_p99_ms:g} ms"
    if target.slo_high_p99_ms is not None:
        goal += f", HIGH p99 <= {target.slo_high_p99_ms:g} ms"
    costs = f", costs {out['cost_mix']}" if out.get("cost_mix") else ""
    # The cost settings planned with, where not the defaults (stored ones included).
    default = Policy()
    costs += "".join(f", {k} {v}" for k, v in out.get("cost_settings", {}).items()
                     if v != getattr(default, k))
    lines = [f"{out['rate']:,g} req/s (mix {out['mix']}{costs}), target {goal}, t(b) = "
             f"{out['cost_ms']} ms", ""]
    best = answer.best
    if best is None:
        return "\n".join([*lines, "nothing to simulate"])
    r = best.result
    if answer.feasible:
        lines.append(f"cheapest: {best.consumers} consumer(s), {_policy_line(best)}   "
                     f"(headroom {best.headroom:.0%})")
    else:
        closest = f"p99 {answer.closest_slo_p99_ms:g} ms"
        if answer.closest_slo_high_p99_ms is not None:
            closest += f", HIGH p99 {answer.closest_slo_high_p99_ms:g} ms"
        lines += [f"no configuration meets the target with at most {out['max_consumers']} "
                  "consumer(s)",
                  f"closest reachable: {closest}, with {best.consumers} consumer(s), "
                  f"{_policy_line(best)}"]
    lines += [f"predicted: throughput {r.throughput_rps:,.1f} req/s, mean batch "
              f"{r.mean_batch}, utilisation {r.utilisation:.1%},",
              f"  p99 all {_p99(best, 'all')} ms, high {_p99(best, 'high')}, normal "
              f"{_p99(best, 'normal')}, low {_p99(best, 'low')}"]
    if answer.runners_up:
        lines += ["", "runners-up (as many consumers):",
                  f"{'strategy':>10}{'batch':>7}{'delay ms':>10}{'p99 ms':>9}{'HIGH p99':>10}"
                  f"{'headroom':>10}"]
        for o in answer.runners_up:
            delay = "-" if o.policy.strategy.value == "fifo" else str(o.policy.max_queue_delay_ms)
            lines.append(f"{o.policy.strategy.value:>10}{o.policy.max_batch_size:>7}"
                         f"{delay:>10}{_p99(o, 'all'):>9}{_p99(o, 'high'):>10}"
                         f"{o.headroom:>10.0%}")
    lines.append(f"\n{answer.simulations} simulations in {out['wall_s']:.2f} s")
    if out.get("applied"):
        lines.append(f"stored as the policy of queue {out['queue']!r}")
    return "\n".join(lines)


@click.command("plan")
@click.option("--rate", type=float, required=True,
              help="Arrival rate to plan for, requests/s, (0, 10000000].")
@click.option("--slo-p99-ms", type=float, required=True,
              help="Target: p99 latency of all requests (submit to result), ms.")
@click.option("--slo-high-p99-ms", type=float, default=None,
              help="Target for HIGH requests' p99 too, ms [default: none].")
@click.option("--mix", default="high=10,normal=60,low=30", show_default=True,
              help="Weights of the priorities among arrivals.")
@click.option("--cost-ms", default=None,
              help="The model's time for a batch of b, A+B*b ms, or per unit of cost, A+B*c "
                   "(as simulate) [default: the stored cost model of --queue].")
@click.option("--cost-mix", default=None,
              help="Request costs as COST:WEIGHT,..., e.g. 16:80,256:20 (as simulate) "
                   "[default: every request costs 1].")
@_policy_option("--max-cost")
@_policy_option("--over-cost")
@_policy_option("--max-batch-cost")
@_policy_option("--cost-mode")
@_policy_option("--cost-buckets")
@click.option("--queue", default=None,
              help="Queue whose stored cost model to plan with (unless --cost-ms), and whose "
                   "policy --apply sets.")
@redis_url_option
@click.option("--max-consumers", type=click.IntRange(1, 4096), default=64, show_default=True,
              help="Most consumers a configuration may have.")
@click.option("--requests", type=click.IntRange(100, 1_000_000), default=DEFAULT_REQUESTS,
              show_default=True,
              help="Requests simulated per configuration tried (the answer is checked on 5x "
                   "as many).")
@click.option("--overhead-ms", type=float, default=DEFAULT_OVERHEAD_MS, show_default=True,
              help="Scheduler time per batch besides the model, ms (as simulate).")
@click.option("--transport-ms", type=float, default=DEFAULT_TRANSPORT_MS, show_default=True,
              help="Latency per request outside queue and model, ms (as simulate).")
@click.option("--seed", type=int, default=1, show_default=True,
              help="Random seed of the simulated arrivals.")
@click.option("--batching", type=click.Choice(["static", "continuous", "compare"]),
              default="static", show_default=True,
              help="Plan for static consumers, for continuous ones (consumer --batching "
                   "continuous: strategy and max_batch_size searched, the slots), or both, "
                   "naming the better.")
@click.option("--step-ms", default=None,
              help="Continuous: a step's time for n sequences, A+B*n ms (as simulate) "
                   "[default: from the cost model].")
@click.option("--prefill-ms", type=float, default=0.0, show_default=True,
              help="Continuous, with --step-ms: ms per sequence joining a step.")
@click.option("--apply", is_flag=True,
              help="Store the policy found for --queue (only if the target is met).")
@click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON.")
def plan_command(rate: float, slo_p99_ms: float, slo_high_p99_ms: float | None, mix: str,
                 cost_ms: str | None, queue: str | None, redis_url: str, max_consumers: int,
                 requests: int, overhead_ms: float, transport_ms: float, seed: int,
                 apply: bool, as_json: bool, cost_mix: str | None = None,
                 max_cost: int | None = None, over_cost: str | None = None,
                 max_batch_cost: int | None = None, cost_mode: str | None = None,
                 cost_buckets: str | None = None, batching: str = "static",
                 step_ms: str | None = None, prefill_ms: float = 0.0) -> None:
    """Find the cheapest configuration (fewest consumers, then the most headroom) whose
    simulated p99 meets the target at --rate: strategy, max_batch_size,
    max_queue_delay_ms and consumers. Without one, say the closest target reachable and
    the consumers it takes. Exits 0 either way. The cost settings are not searched: every
    configuration has those given (or the queue's)."""
    started = time.perf_counter()
    target = Target(slo_p99_ms, slo_high_p99_ms)
    weights = parse_mix(mix)
    mix_of_costs = tuple(parse_cost_mix(cost_mix)) if cost_mix is not None else ()
    load = Load(rate, weights, requests, seed, mix_of_costs)
    if queue is None and (apply or cost_ms is None):
        raise InvalidRequest("queue", "--apply needs --queue" if apply else
                             "give --cost-ms, or --queue to use its stored cost model")
    client = connect_checked(redis_url) if queue is not None else None
    keys = QueueKeys(queue) if queue is not None else None
    base = Policy()
    if client is not None and keys is not None:
        from scheduler_core.admin import read_policy

        base = read_policy(client, keys.queue) or base
    cost_knobs = {k: v for k, v in (("max_cost", max_cost), ("over_cost", over_cost),
                                    ("max_batch_cost", max_batch_cost),
                                    ("cost_mode", cost_mode), ("cost_buckets", cost_buckets))
                  if v is not None}
    base = replace(base, **cost_knobs)  # validated as Policy validates
    if apply and base.cost_buckets and not mix_of_costs:
        # Without a cost mix every simulated request costs 1: the buckets play no part in
        # the plan, so the policy stored would not be the one planned.
        raise InvalidRequest("cost_mix", f"the plan has cost_buckets {base.cost_buckets!r}"
                                         f"{' (stored)' if cost_buckets is None else ''} "
                                         "but no --cost-mix, so every simulated request "
                                         "costs 1 and the buckets play no part: give "
                                         "--cost-mix, or --cost-buckets '' to plan and "
                                         "store none")
    if cost_ms is not None:
        model = CostModel.parse(cost_ms)
    else:
        assert client is not None and keys is not None
        stored = read_cost_model(client, keys)
        if stored is None:
            raise InvalidRequest("queue", f"queue {queue!r} has no stored cost model yet "
                                          "(batchgate profile --queue, or run consumers); "
                                          "give --cost-ms")
        model = CostModel(stored.base_ms, stored.per_item_ms)
    costs = Costs(model, overhead_ms, transport_ms,
                  mean_cost(mix_of_costs, base) if mix_of_costs else 1.0)
    step = StepTime.parse(step_ms, prefill_ms) if step_ms else None
    modes = list(BATCHING) if batching == "compare" else [batching]
    plans = {mode: plan(load, target, costs, max_consumers, base, mode, step)
             for mode in modes}
    chosen = better(plans)
    answer = plans[chosen]
    out: dict[str, Any] = answer.to_dict()
    if batching == "compare":
        out["compared"] = {mode: p.to_dict() for mode, p in plans.items()}
    out.update({"rate": rate, "mix": mix, "slo_p99_ms": slo_p99_ms,
                "slo_high_p99_ms": slo_high_p99_ms, "cost_ms": str(model).removesuffix(" ms"),
                "cost_mix": cost_mix,
                "max_consumers": max_consumers, "queue": queue, "applied": False,
                "cost_settings": {k: getattr(base, k) for k in COST_SETTINGS}})
    if apply:
        if answer.feasible and answer.best is not None and client is not None:
            from scheduler_core.admin import change_policy

            best = answer.best.policy
            # The policy planned: its cost settings too, stored or given alike.
            change_policy(client, queue, {"strategy": best.strategy.value,
                                          "max_batch_size": best.max_batch_size,
                                          "max_queue_delay_ms": best.max_queue_delay_ms,
                                          **{k: getattr(best, k) for k in COST_SETTINGS}})
            out["applied"] = True
        else:
            click.echo("nothing applied: no configuration meets the target", err=True)
    out["wall_s"] = round(time.perf_counter() - started, 3)
    if as_json:
        click.echo(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())
    elif batching == "compare":
        click.echo(render_compare(out, plans, chosen, target))
    else:
        click.echo(render(out, answer, target))


def render_compare(out: dict[str, Any], plans: dict[str, Plan], chosen: str,
                   target: Target) -> str:
    """`--batching compare`: each mode's plan, then the better one named."""
    parts = []
    for mode, answer in plans.items():
        text = render({**out, "applied": False}, answer, target).split("\n")
        parts += [f"-- {mode} batching --", *text[2:-1], ""]
    parts = render(out, plans[chosen], target).split("\n")[:2] + parts
    why = "meets the target with fewer consumers or more headroom" if plans[chosen].feasible \
        else "comes closest to the target"
    parts.append(f"better: {chosen} batching ({why})")
    if chosen == "continuous":
        parts.append("  (run the consumers with --batching continuous)")
    parts.append(f"{sum(p.simulations for p in plans.values())} simulations in "
                 f"{out['wall_s']:.2f} s")
    if out.get("applied"):
        parts.append(f"stored as the policy of queue {out['queue']!r}")
    return "\n".join(parts)
