"""`batchgate profile`: a model's time per batch, t(b), measured and fitted to A + B·b.

The model is loaded as `batchgate consumer` loads it (--model, --model-arg, --device),
warmed up, then called `--repeat` times with a batch of each size (copies of one
payload); the median of each size is fitted by least squares. The fit is what
`batchgate simulate --cost-ms` takes; R² and the fit's error at each size say how far to
trust it (a model whose time grows in steps, e.g. padded to fixed shapes, fits badly).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import click
import orjson

from consumer.cli import parse_model_args
from consumer.loader import BatchModel, load_model
from scheduler_core.compat import connect_checked
from scheduler_core.cost_model import CostModel, Fit, fit, write_cost_model
from scheduler_core.errors import InvalidRequest
from scheduler_core.keys import QueueKeys
from scheduler_core.ops.options import redis_url_option
from scheduler_core.policy import LIMITS

# One payload every built-in model takes: synthetic and noop ignore it, tiny_text reads
# "tokens", minilm "text".
DEFAULT_PAYLOAD = '{"text": "the quick brown fox jumps over the lazy dog", ' \
                  '"tokens": [5, 17, 42, 7, 99, 3, 250, 12, 8, 64, 31, 2, 77, 19, 6, 140]}'


def measure(model: BatchModel, payload: Any, sizes: list[int], warmup: int,
            repeat: int) -> dict[int, list[float]]:
    """ms of each call, per batch size; `warmup` unmeasured calls per size first."""
    times: dict[int, list[float]] = {}
    for size in sizes:
        batch = [payload] * size
        for _ in range(warmup):
            model(batch)
        runs = []
        for _ in range(repeat):
            start = time.perf_counter()
            model(batch)  # results come back as Python values: a device has synchronised
            runs.append((time.perf_counter() - start) * 1000)
        times[size] = runs
    return times


def parse_sizes(text: str) -> list[int]:
    low, high = LIMITS["max_batch_size"]
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        sizes = []
    if not sizes or not all(low <= b <= high for b in sizes):
        raise InvalidRequest("batch_sizes", f"{text!r}: comma-separated integers in "
                                            f"[{low}, {high}], e.g. 1,2,4,8,16,32")
    return sizes


def report(model_spec: str, times: dict[int, list[float]], warmup: int,
           repeat: int) -> dict[str, Any]:
    medians = {b: statistics.median(runs) for b, runs in times.items()}
    line = fit(list(medians.items()))
    points = []
    for b, runs in times.items():
        error = line.ms(b) - medians[b]
        points.append({"batch": b, "median_ms": round(medians[b], 4),
                       "min_ms": round(min(runs), 4), "max_ms": round(max(runs), 4),
                       "fit_ms": round(line.ms(b), 4), "error_ms": round(error, 4),
                       "error_pct": round(100 * error / medians[b], 2) if medians[b] else None})
    return {"model": model_spec, "warmup": warmup, "repeat": repeat, "points": points,
            "fit": {"base_ms": round(line.base_ms, 4), "per_item_ms": round(line.per_item_ms, 4),
                    "r2": round(line.r2, 5), "cost_ms": line.cost_ms}}


def render(out: dict[str, Any]) -> str:
    f = out["fit"]
    lines = [f"{out['model']}: median of {out['repeat']} runs per batch size "
             f"(after {out['warmup']} warm-up)", "",
             f"{'batch':>6}{'median ms':>12}{'min':>10}{'max':>10}{'fit':>10}{'error':>10}"]
    for p in out["points"]:
        pct = "" if p["error_pct"] is None else f" ({p['error_pct']:+.1f}%)"
        lines.append(f"{p['batch']:>6}{p['median_ms']:>12.3f}{p['min_ms']:>10.3f}"
                     f"{p['max_ms']:>10.3f}{p['fit_ms']:>10.3f}{p['error_ms']:>+10.3f}{pct}")
    lines += ["", f"t(b) = {f['base_ms']:.4g} + {f['per_item_ms']:.4g}·b ms, "
                  f"R² = {f['r2']:.4f}",
              f"batchgate simulate --cost-ms '{f['cost_ms']}'"]
    if "stored" in out:
        lines.append(f"stored as the cost model of queue {out['stored']['queue']!r}")
    return "\n".join(lines)


@click.command("profile")
@click.option("--model", "model_spec", default="consumer.models:synthetic", show_default=True,
              help="MODULE:ATTR of a batch model, or of a zero-argument factory returning one "
                   "(as batchgate consumer takes it).")
@click.option("--model-arg", multiple=True, metavar="KEY=VALUE",
              help="Keyword argument for the model factory (value parsed as JSON if it can "
                   "be). Repeatable.")
@click.option("--device", default=None,
              help="Device for torch models (cpu, cuda:0, ...), passed to the factory as "
                   "device=.")
@click.option("--batch-sizes", default="1,2,4,8,16,32", show_default=True,
              help="Comma-separated batch sizes to time (at least two distinct).")
@click.option("--payload", default=DEFAULT_PAYLOAD,
              help="JSON payload a batch is made of (copies) [default: one every built-in "
                   "model takes].")
@click.option("--warmup", type=click.IntRange(0, 1000), default=3, show_default=True,
              help="Unmeasured calls per batch size first.")
@click.option("--repeat", type=click.IntRange(1, 10_000), default=10, show_default=True,
              help="Measured calls per batch size (the median counts).")
@click.option("--queue", default=None,
              help="Also store the fit as this queue's cost model (read by batchgate plan "
                   "--queue, recommended_consumers and the consumers; they refit it live).")
@redis_url_option
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def profile_command(model_spec: str, model_arg: tuple[str, ...], device: str | None,
                    batch_sizes: str, payload: str, warmup: int, repeat: int,
                    queue: str | None, redis_url: str, as_json: bool) -> None:
    """Time a model on batches of each size, fit t(b) = A + B·b (least squares on the
    medians) and report R² and the fit's error at each size: the --cost-ms of
    batchgate simulate. With --queue, store it as the queue's cost model."""
    keys = QueueKeys(queue) if queue is not None else None  # a bad name fails before timing
    client = connect_checked(redis_url) if keys is not None else None
    sizes = parse_sizes(batch_sizes)
    if len(sizes) < 2:
        raise InvalidRequest("batch_sizes", "need at least two distinct batch sizes to fit")
    try:
        sample = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest("payload", f"not JSON: {exc}") from None
    kwargs = parse_model_args(model_arg)
    flags = dict.fromkeys(kwargs, "--model-arg")
    if device is not None:
        kwargs["device"], flags["device"] = device, "--device"
    model = load_model(model_spec, kwargs, flags)
    out = report(model_spec, measure(model, sample, sizes, warmup, repeat), warmup, repeat)
    if keys is not None and client is not None:
        f = out["fit"]
        line = Fit(f["base_ms"], f["per_item_ms"], f["r2"])
        stored = write_cost_model(client, keys, CostModel.from_fit(
            line, len(sizes) * repeat, "profile"))
        out["stored"] = {"queue": queue, **stored.to_dict()}
    if as_json:
        click.echo(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())
    else:
        click.echo(render(out))
