"""`batchgate simulate`: a queue's latency and throughput predicted before deploying it.

The simulator itself is scheduler_core.ops.simulation (the planner uses it too); this
module gives it its arrivals (Poisson, bursty, or a trace file), request costs (a cost
mix, `--cost-mix 16:80,256:20`, or a trace's "cost" field) and the command.

    from batchgate.simulate import CostModel, SimConfig, poisson_arrivals, simulate
    result = simulate(SimConfig(Policy(), CostModel(5, 0.5), consumers=2),
                      *poisson_arrivals(rate=1000, duration_s=10))
"""

from __future__ import annotations

import math
import re
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any

import click
import orjson

from batchgate.workload import MIX, PRIORITIES, Workload
from scheduler_core.errors import InvalidRequest
from scheduler_core.ops.continuous_sim import DEFAULT_STEP_OVERHEAD_MS, StepTime
from scheduler_core.ops.options import POLICY_KNOBS
from scheduler_core.ops.simulation import (  # noqa: F401 (the importable API, as before)
    AUTO_LEAD,
    BATCHING,
    DEFAULT_FETCH,
    DEFAULT_FINISH,
    DEFAULT_OVERHEAD_MS,
    DEFAULT_REACT_MS,
    DEFAULT_TRANSPORT_MS,
    MAX_REQUESTS,
    PathTime,
    SimConfig,
    SimResult,
    _Level,
    draw_costs,
    jitter_ratios,
    path_offsets,
    simulate,
)
from scheduler_core.ops.simulation import ModelTime as CostModel
from scheduler_core.policy import MAX_REQUEST_COST, Policy, Priority, is_auto

Arrivals = tuple[list[float], list[int]]  # (offsets in s, sorted; priorities 0-2)
_COST_MIX = re.compile(r"^\s*(\d+)\s*:\s*(\d+(?:\.\d*)?)\s*$")


# -- arrivals -----------------------------------------------------------------------------
def poisson_arrivals(rate: float, duration_s: float, mix: tuple[float, ...] = MIX,
                     seed: int = 1, bursty: bool = False) -> Arrivals:
    """python -m bench.run's workload generator (same seed, same requests): Poisson at `rate`
    for `duration_s`; bursty adds 50 requests within 100 ms every 2 s."""
    if not (isinstance(rate, (int, float)) and 0 < rate <= 10_000_000):
        raise InvalidRequest("rate", f"must be within (0, 10000000] requests/s, got {rate!r}")
    if not (isinstance(duration_s, (int, float)) and 0 < duration_s <= 1_000_000):
        raise InvalidRequest("duration_s", f"must be within (0, 1000000] s, got "
                                           f"{duration_s!r}")
    if rate * duration_s > MAX_REQUESTS:
        raise InvalidRequest("rate", f"rate x duration_s = {rate * duration_s:,.0f} requests; "
                                     f"at most {MAX_REQUESTS:,}")
    kind = "bursty" if bursty else "poisson"
    return Workload(kind, rate=rate, duration_s=duration_s, seed=seed).schedule(mix)


def parse_mix(text: str) -> tuple[float, float, float]:
    """"high=10,normal=60,low=30" -> weights (HIGH, NORMAL, LOW); unnamed ones are 0."""
    weights = dict.fromkeys(PRIORITIES, 0.0)
    for part in text.split(","):
        name, _, value = part.partition("=")
        name = name.strip().lower()
        try:
            weight = float(value)
        except ValueError:
            weight = -1.0
        if name not in weights or not 0 <= weight < math.inf:
            raise InvalidRequest("mix", f"{part.strip()!r}: use high=W,normal=W,low=W with "
                                        "weights >= 0")
        weights[name] = weight
    if sum(weights.values()) <= 0:
        raise InvalidRequest("mix", "the weights add up to 0")
    high, normal, low = (weights[p] for p in PRIORITIES)
    return high, normal, low


def parse_cost_mix(text: str) -> list[tuple[int, float]]:
    """"16:80,256:20" (cost:percent, or any weights) -> [(16, 80.0), (256, 20.0)]."""
    mix = []
    for part in text.split(","):
        m = _COST_MIX.match(part)
        if not m or not 1 <= int(m.group(1)) <= MAX_REQUEST_COST:
            raise InvalidRequest("cost_mix", f"{part.strip()!r}: use COST:WEIGHT,... with "
                                             f"costs in [1, {MAX_REQUEST_COST}], e.g. "
                                             "16:80,256:20")
        mix.append((int(m.group(1)), float(m.group(2))))
    if sum(w for _, w in mix) <= 0:
        raise InvalidRequest("cost_mix", "the weights add up to 0")
    return mix


def _parse_prefs(text: str, field: str = "prefer_buckets") -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise InvalidRequest(field, f"{text!r}: use one integer per consumer, e.g. 1,0"
                             ) from None


def read_trace(path: Path) -> Arrivals:
    """A JSONL trace: one {"t": seconds since the start, "priority": "high"|"normal"|"low"
    or 0-2 (optional, default normal)} per line, in any order."""
    return read_trace_costs(path)[:2]  # type: ignore[return-value]


def read_trace_costs(path: Path) -> tuple[list[float], list[int], list[int] | None]:
    """read_trace, with each line's optional "cost" (an integer >= 1, default 1); costs is
    None when no line has one."""
    rows: list[tuple[float, int, int]] = []
    any_cost = False
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise InvalidRequest("trace", f"{path}:{number}: not JSON ({exc})") from None
            t = row.get("t") if isinstance(row, dict) else None
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < 1e9:
                raise InvalidRequest("trace", f"{path}:{number}: \"t\" must be seconds in "
                                              f"[0, 1e9), got {t!r}")
            prio = Priority.parse(row.get("priority", "normal"), f"trace line {number}")
            c = row.get("cost", 1)
            if isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= MAX_REQUEST_COST:
                raise InvalidRequest("trace", f"{path}:{number}: \"cost\" must be an integer "
                                              f"in [1, {MAX_REQUEST_COST}], got {c!r}")
            any_cost = any_cost or "cost" in row
            rows.append((float(t), int(prio), c))
            if len(rows) > MAX_REQUESTS:
                raise InvalidRequest("trace", f"more than {MAX_REQUESTS:,} requests")
    if not rows:
        raise InvalidRequest("trace", f"{path} has no requests")
    rows.sort(key=lambda r: r[0])
    return ([t for t, _, _ in rows], [p for _, p, _ in rows],
            [c for _, _, c in rows] if any_cost else None)


def read_model_samples(path: Path) -> list[tuple[int, float]]:
    """Model-time samples, one "size:model_us" per line (what a queue's
    `{bg:q}:samples:model` list holds: `redis-cli LRANGE '{bg:q}:samples:model' 0 -1`),
    as (batch size, ms). Blank lines are skipped."""
    out: list[tuple[int, float]] = []
    with path.open() as f:
        for number, line in enumerate(f, 1):
            text = line.strip().strip('"')
            if not text:
                continue
            size, _, us = text.partition(":")
            try:
                b, t = int(size), float(us)
            except ValueError:
                b, t = 0, -1.0
            if not 1 <= b <= 100_000 or not 0 <= t <= 3.6e9:
                raise InvalidRequest("cost_jitter", f"{path}:{number}: {text!r} is not "
                                                    "SIZE:MODEL_US (e.g. 32:21050)")
            out.append((b, t / 1000))
            if len(out) > MAX_REQUESTS:
                raise InvalidRequest("cost_jitter", f"more than {MAX_REQUESTS:,} samples")
    return out


def read_path_samples(path: Path) -> list[float]:
    """Measured path times, ms, one per line (a bench run's `path_samples_ms`: intended
    arrival -> enqueue plus model end -> result seen, per request). Blank lines are
    skipped."""
    out: list[float] = []
    with path.open() as f:
        for number, line in enumerate(f, 1):
            text = line.strip()
            if not text:
                continue
            try:
                ms = float(text)
            except ValueError:
                ms = -1.0
            if not 0 <= ms <= 60_000:
                raise InvalidRequest("path_spread", f"{path}:{number}: {text!r} is not a time "
                                                    "in ms within [0, 60000]")
            out.append(ms)
            if len(out) > MAX_REQUESTS:
                raise InvalidRequest("path_spread", f"more than {MAX_REQUESTS:,} samples")
    return out


# -- the command --------------------------------------------------------------------------
def _policy_option(flag: str) -> Any:
    """The same option, help and limits as `batchgate policy set` has."""
    _, kwargs, text = next(k for k in POLICY_KNOBS if k[0] == flag)
    return click.option(flag, help=text, **kwargs)


def render(result: SimResult, config: SimConfig, workload: str) -> str:
    p = config.policy
    prose = [
        f"{result.requests:,} requests ({workload}), {config.consumers} consumer(s)"
        + (f" preferring buckets {','.join(map(str, config.prefer_buckets))}"
           if config.prefer_buckets else "")
        + (f" dedicated to buckets {','.join(map(str, config.only_buckets))}"
           if config.only_buckets else "") + ", "
        f"t(b) = {config.cost}"
        + (f" x a measured ratio ({len(config.jitter):,} samples)" if config.jitter else "")
        + f", overhead {config.overhead_ms:g} ms per batch, fetch {config.fetch}, finish "
        f"{config.finish}, fetch ahead "
        + ("2 x fetch + 0.5 ms" if config.lead_ms == AUTO_LEAD else f"{config.lead_ms:g} ms")
        + f" early, transport {config.transport_ms:g} ms per request"
        + (f" (path spread from {len(config.path_spread):,} samples)"
           if config.path_spread else "")
        + f", the next consumer {config.react_ms:g} ms after a pop",
        f"policy: {p.strategy}, max_batch_size {p.max_batch_size}, max_queue_delay_ms "
        f"{p.max_queue_delay_ms}, aging_ms {p.aging_ms}" + (
            f", max_cost {p.max_cost} ({p.over_cost}), max_batch_cost {p.max_batch_cost} "
            f"({p.cost_mode}), cost_buckets {p.cost_buckets or '-'}"
            if result.latency_by_cost else ""),
    ]
    if config.batching == "continuous":
        step = config.step or StepTime.from_model(config.cost)
        prose.append(f"continuous batching: a step = {step}, overhead "
                     f"{config.step_overhead_ms:g} ms per step; the batches below are steps, "
                     "their size the sequences each ran")
    # The description wraps at 100 columns, as the tables below fit them.
    lines = [*(textwrap.fill(line, 100, subsequent_indent="  ") for line in prose),
        "",
        f"throughput {result.throughput_rps:,.1f} req/s   mean batch {result.mean_batch}   "
        f"utilisation {result.utilisation:.1%}   ({result.batches:,} batches over "
        f"{result.span_s:,.2f} s)",
        "",
        f"{'latency ms':<10}{'p50':>10}{'p95':>10}{'p99':>10}{'max':>10}{'requests':>11}",
    ]
    for name, s in result.latency_ms.items():
        count = result.requests if name == "all" else result.counts[name]
        cells = "".join(f"{'-' if s[k] is None else f'{s[k]:.2f}':>10}"
                        for k in ("p50", "p95", "p99", "max"))
        lines.append(f"{name:<10}{cells}{count:>11,}")
    for c, s in result.latency_by_cost.items():
        cells = "".join(f"{'-' if s[k] is None else f'{s[k]:.2f}':>10}"
                        for k in ("p50", "p95", "p99", "max"))
        lines.append(f"{'cost ' + str(c):<10}{cells}")
    if result.latency_by_cost:
        lines += ["", f"padding waste {result.padding_waste:.1%} (sum of max - cost over sum "
                      f"of max, per batch)   refused over max_cost {result.rejected:,}   "
                      f"capped {result.truncated:,}"]
    lines += ["", "batch size   batches   share"]
    lo = 1
    while lo <= p.max_batch_size:  # bins up to a power of two: 1, 2, 3-4, 5-8, ...
        hi = min(p.max_batch_size, 1 << (lo - 1).bit_length())
        k = sum(v for b, v in result.batch_histogram.items() if lo <= b <= hi)
        if k:
            label = str(lo) if lo == hi else f"{lo}-{hi}"
            lines.append(f"{label:>10}{k:>10,}{k / result.batches:>8.1%}")
        lo = hi + 1
    lines.append(f"\nsimulated in {result.wall_s:.2f} s")
    return "\n".join(lines)


@click.command("simulate")
@_policy_option("--strategy")
@_policy_option("--max-batch-size")
@_policy_option("--max-queue-delay-ms")
@_policy_option("--aging-ms")
@_policy_option("--max-cost")
@_policy_option("--over-cost")
@_policy_option("--max-batch-cost")
@_policy_option("--cost-mode")
@_policy_option("--cost-buckets")
@click.option("--cost-mix", default=None,
              help="Request costs as COST:WEIGHT,..., e.g. 16:80,256:20 (80% cost 16, 20% "
                   "cost 256) [default: every request costs 1; a --trace line's \"cost\"].")
@click.option("--arrivals", type=click.Choice(["poisson", "bursty"]), default="poisson",
              show_default=True, help="Poisson at --rate; bursty adds 50 requests within "
              "100 ms every 2 s.")
@click.option("--rate", type=float, default=1000.0, show_default=True,
              help="Mean arrival rate, requests/s, (0, 10000000].")
@click.option("--duration-s", type=float, default=10.0, show_default=True,
              help="Seconds of arrivals, (0, 1000000].")
@click.option("--mix", default="high=10,normal=60,low=30", show_default=True,
              help="Weights of the priorities among arrivals.")
@click.option("--trace", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help='Arrivals from a JSONL file of {"t": s, "priority": "high"|"normal"|"low"}'
                   " instead (--arrivals, --rate, --duration-s, --mix unused).")
@click.option("--consumers", type=int, default=2, show_default=True,
              help="Consumer processes, 1-4096.")
@click.option("--cost-ms", default="5+0.5*b", show_default=True,
              help="The model's time for a batch of b, A+B*b ms (batchgate profile fits it), "
                   "or per unit of cost, A+B*c: c = sum of the costs, or b x largest cost "
                   "with --cost-mode padded.")
@click.option("--prefer-buckets", default=None,
              help="Each consumer's --prefer-bucket, comma-separated, one per consumer, e.g. "
                   "1,0 (0 = none) [default: none].")
@click.option("--only-buckets", default=None,
              help="Each consumer's --only-bucket, comma-separated, one per consumer, e.g. "
                   "1,0: the first serves bucket 1 only (0 = every bucket) [default: none].")
@click.option("--overhead-ms", type=float, default=DEFAULT_OVERHEAD_MS, show_default=True,
              help="Consumer time between two batches when the next one was fetched ahead "
                   "(a backlog), ms (default: the measured gap at saturation).")
@click.option("--fetch-ms", default=str(DEFAULT_FETCH).removesuffix(" ms"),
              show_default=True,
              help="Pop to model start for a batch of b, A+B*b ms; on the consumer unless "
                   "fetched ahead (default: fitted to the benchmark grid).")
@click.option("--finish-ms", default=str(DEFAULT_FINISH).removesuffix(" ms"),
              show_default=True,
              help="Model end to result seen for a batch of b, A+B*b ms; on the consumer "
                   "only when nothing was left waiting at its pop (default: fitted to the "
                   "benchmark grid).")
@click.option("--lead-ms", type=float, default=None,
              help="How long before its model ends a consumer fetching ahead (a backlog "
                   "waits) pops its next batch, ms; 0 = at the end [default: twice "
                   "--fetch-ms of the running batch plus 0.5, as consumer/overlap.py].")
@click.option("--transport-ms", type=float, default=DEFAULT_TRANSPORT_MS, show_default=True,
              help="Submit to enqueue, ms per request; occupies no consumer (default: "
                   "measured on the benchmark grid).")
@click.option("--react-ms", type=float, default=DEFAULT_REACT_MS, show_default=True,
              help="From a pop that leaves work waiting to the next idle consumer's own pop, "
                   "ms; 0 = at the same instant (default: fitted to the benchmark's "
                   "priority runs).")
@click.option("--cost-jitter", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None,
              help="Measured model times, one SIZE:MODEL_US per line (a queue's "
                   "{bg:q}:samples:model list): each batch's t(b) is multiplied by one of "
                   "their ratios to their own A+B*b fit, drawn with --seed [default: none].")
@click.option("--path-samples", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None,
              help="Measured path times, ms, one per line (a bench run's path_samples_ms): "
                   "each request's result is seen later or earlier by one of their "
                   "differences from their mean, drawn with --seed: the path's spread, "
                   "which its constant terms leave out [default: none].")
@click.option("--batching", type=click.Choice(["static", "continuous", "compare"]),
              default="static", show_default=True,
              help="static: a popped batch runs to its end; continuous: requests join and "
                   "leave a running batch at every step (consumer --batching continuous); "
                   "compare: both, side by side, naming the lower p99.")
@click.option("--step-ms", default=None,
              help="Continuous: a step's time for n running sequences, A+B*n ms, plus "
                   "--prefill-ms per sequence joining [default: from --cost-ms: A+B*c gives "
                   "B*n and a prefill of A; A+B*b gives A+B*n, no prefill].")
@click.option("--prefill-ms", type=float, default=0.0, show_default=True,
              help="Continuous, with --step-ms: ms per sequence joining a step.")
@click.option("--step-overhead-ms", type=float, default=DEFAULT_STEP_OVERHEAD_MS,
              show_default=True,
              help="Continuous: the consumer loop's own time per step besides the model, ms.")
@click.option("--seed", type=int, default=1, show_default=True,
              help="Random seed of the arrivals (that of python -m bench.run gives its requests).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def simulate_command(strategy: str | None, max_batch_size: int | None,
                     max_queue_delay_ms: int | None, aging_ms: int | None,
                     max_cost: int | None, over_cost: str | None, max_batch_cost: int | None,
                     cost_mode: str | None, cost_buckets: str | None, cost_mix: str | None,
                     arrivals: str,
                     rate: float, duration_s: float, mix: str, trace: Path | None,
                     consumers: int, prefer_buckets: str | None, only_buckets: str | None,
                     cost_ms: str,
                     overhead_ms: float, fetch_ms: str, finish_ms: str,
                     lead_ms: float | None, transport_ms: float, react_ms: float,
                     cost_jitter: Path | None, path_samples: Path | None, seed: int,
                     as_json: bool, batching: str = "static", step_ms: str | None = None,
                     prefill_ms: float = 0.0,
                     step_overhead_ms: float = DEFAULT_STEP_OVERHEAD_MS) -> None:
    """Predict latency per priority, throughput, batch sizes and utilisation of a queue
    policy on a workload, by a discrete-event simulation of the scheduling rules (no
    Redis, no model: about a million requests in seconds)."""
    if is_auto(max_queue_delay_ms):  # the option is policy set's, which also takes auto
        raise click.BadParameter("auto is not simulated: give the delay in ms",
                                 param_hint="--max-queue-delay-ms")
    policy = Policy.build(strategy, max_batch_size=max_batch_size,
                          max_queue_delay_ms=max_queue_delay_ms, aging_ms=aging_ms,
                          max_cost=max_cost, over_cost=over_cost, max_batch_cost=max_batch_cost,
                          cost_mode=cost_mode, cost_buckets=cost_buckets)
    prefs = _parse_prefs(prefer_buckets) if prefer_buckets else ()
    jitter = jitter_ratios(read_model_samples(cost_jitter)) if cost_jitter else ()
    config = SimConfig(policy, CostModel.parse(cost_ms), consumers, overhead_ms, transport_ms,
                       prefs, PathTime.parse(fetch_ms, "fetch_ms"),
                       PathTime.parse(finish_ms, "finish_ms"), jitter, seed,
                       _parse_prefs(only_buckets, "only_buckets") if only_buckets else (),
                       AUTO_LEAD if lead_ms is None else lead_ms, react_ms,
                       path_offsets(read_path_samples(path_samples)) if path_samples else (),
                       step=StepTime.parse(step_ms, prefill_ms) if step_ms else None,
                       step_overhead_ms=step_overhead_ms)
    mix_of_costs = parse_cost_mix(cost_mix) if cost_mix is not None else None
    costs: list[int] | None = None
    if trace is not None:
        times, prios, costs = read_trace_costs(trace)
        workload = f"trace {trace.name}"
    else:
        weights = parse_mix(mix)
        times, prios = poisson_arrivals(rate, duration_s, weights, seed, arrivals == "bursty")
        workload = f"{arrivals} {rate:g}/s for {duration_s:g} s, mix {mix}, seed {seed}"
    if not times:
        raise click.UsageError("no requests arrive: raise --rate or --duration-s")
    if mix_of_costs is not None:
        costs = draw_costs(len(times), mix_of_costs, seed)
        workload += f", costs {cost_mix}"
    if batching == "compare":
        both = {mode: simulate(replace(config, batching=mode), times, prios, costs)
                for mode in BATCHING}
        better = lower_p99(both)
        if as_json:
            click.echo(orjson.dumps({**{m: r.to_dict() for m, r in both.items()},
                                     "better": better}, option=orjson.OPT_INDENT_2).decode())
        else:
            click.echo(render_compare(both, config, workload, better))
        return
    config = replace(config, batching=batching)
    result = simulate(config, times, prios, costs)
    if as_json:
        click.echo(orjson.dumps(result.to_dict(), option=orjson.OPT_INDENT_2).decode())
    else:
        click.echo(render(result, config, workload))


def lower_p99(results: dict[str, SimResult]) -> str:
    """The mode whose p99 of all requests is lower (static on a tie)."""
    return min(results, key=lambda m: (results[m].latency_ms["all"]["p99"] or 0.0,
                                       m != "static"))


def render_compare(results: dict[str, SimResult], config: SimConfig, workload: str,
                   better: str) -> str:
    """`--batching compare`: the two modes side by side on the same arrivals."""
    step = config.step or StepTime.from_model(config.cost)
    lines = [f"{workload}; {config.consumers} consumer(s), policy {config.policy.strategy}, "
             f"max_batch_size {config.policy.max_batch_size}; static t(b) = {config.cost}; "
             f"continuous step = {step}, overhead {config.step_overhead_ms:g} ms per step",
             "",
             f"{'':<22}{'static':>12}{'continuous':>12}",
             f"{'throughput req/s':<22}" + "".join(
                 f"{results[m].throughput_rps:>12,.1f}" for m in BATCHING)]
    groups = [("all", results["static"].latency_ms["all"],
               results["continuous"].latency_ms["all"])]
    groups += [(f"cost {c}", results["static"].latency_by_cost.get(c, {}),
                results["continuous"].latency_by_cost.get(c, {}))
               for c in results["static"].latency_by_cost]
    for name, a, b in groups:
        for key in ("p50", "p99"):
            cells = "".join(f"{'-' if x.get(key) is None else f'{x[key]:.2f}':>12}"
                            for x in (a, b))
            lines.append(f"{name + ' ' + key + ' ms':<22}{cells}")
    lines += ["", f"better: {better} (lower p99 of all requests)"]
    return "\n".join(lines)
