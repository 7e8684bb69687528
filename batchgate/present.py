"""For people: the figures `batchgate stats`, `top` and the dashboard show, with their
units ("108.6 ms", "135.6 req/s", "updated 2 s ago"), busy queues first. The policy and
the delay in use are worded by scheduler_core.policy.describe_policy / describe_delay."""

from __future__ import annotations

import textwrap
import time
from typing import Any

from scheduler_core.ops.stats import top_tenants
from scheduler_core.policy import describe_delay, describe_policy

NONE = "-"
WIDTH = 100  # every table fits a terminal this wide
LABEL = 17  # the label column of `batchgate stats`
BLOCKS = "▁▂▃▄▅▆▇█"


def ms(value: float | None) -> str:
    """A latency: "0.4 ms", "108.6 ms", "3.68 s"."""
    if value is None:
        return NONE
    return f"{value:.1f} ms" if value < 1000 else f"{value / 1000:.2f} s"


def per_s(value: float | None, unit: str = "req/s") -> str:
    return NONE if value is None else f"{value:.1f} {unit}"


def ago(seconds: float) -> str:
    """How long ago: "2 s ago", "5 min ago", "3 h ago", "2 d ago"."""
    seconds = max(0.0, seconds)
    for size, unit in ((86_400, "d"), (3600, "h"), (60, "min")):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"


def busy(snap: dict[str, Any]) -> bool:
    """Something waits or runs, requests came or went over the rates' window, or dead
    letters wait for a look; otherwise the queue is idle (the dashboard folds it)."""
    rates = snap.get("rates") or {}
    return bool(sum(snap["depth"].values()) or snap["in_flight_requests"]
                or rates.get("arrived_per_s") or rates.get("completed_per_s")
                or snap["dead_letters"])


def busy_first(snaps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Busy queues first, then idle ones; by name within each group (a stable order)."""
    return sorted(snaps, key=lambda s: (not busy(s), s["queue"]))


def delay_text(snap: dict[str, Any]) -> str:
    return describe_delay(snap["policy"], snap["max_queue_delay_ms_in_use"])


def policy_text(snap: dict[str, Any]) -> str:
    return describe_policy(snap["policy"], snap["max_queue_delay_ms_in_use"])


def for_people(snap: dict[str, Any]) -> dict[str, Any]:
    """Add what the dashboard shows as words: "busy", "policy_text", "delay_text"."""
    snap.update(busy=busy(snap), policy_text=policy_text(snap), delay_text=delay_text(snap))
    return snap


def sparkline(batch_sizes: dict[str, int], width: int = 16) -> str:
    """The batch-size histogram in one line: "1 █▃▁ ▁ 16" (sizes 1 to the largest seen,
    up to `width` cells, each the highest count among the sizes it covers)."""
    counts = {int(size): n for size, n in batch_sizes.items()}
    if not counts:
        return "no batches yet"
    largest = max(counts)
    cells = min(width, largest)
    heights = [0] * cells
    for size, n in counts.items():
        cell = (size - 1) * cells // largest
        heights[cell] = max(heights[cell], n)
    most = max(heights)
    bars = "".join(" " if h == 0 else BLOCKS[min(7, (h * 8 - 1) // most)] for h in heights)
    return f"1 {bars} {largest}"


def _latency_rows(stats: dict[str, Any]) -> list[str]:
    rows = [f"{'latency':<{LABEL}}{'p50':>10}{'p99':>11}{'samples':>10}"]
    for label, key in (("queue wait", "queue_wait_ms"), ("end to end", "end_to_end_ms"),
                       ("model per batch", "model_ms")):
        q = stats[key]
        rows.append(f"{label:<{LABEL}}{ms(q['p50']):>10}{ms(q['p99']):>11}"
                    f"{q['samples']:>10,}")
    return rows


def _cost_model(model: dict[str, Any] | None, now_s: float) -> str:
    if model is None:
        return "none yet (`batchgate profile`, or consumers fit one as they run)"
    text = (f"t(b) = {model['a_us'] / 1000:.2f} ms + {model['b_us'] / 1000:.3f} ms × b "
            f"({model['source']}, {model['samples']:,} batches, r² {model['r2']:.2f}")
    if model.get("updated_us"):
        text += ", updated " + ago(now_s - model["updated_us"] / 1e6)
    return text + ")"


def _recommended(stats: dict[str, Any]) -> str:
    n = stats.get("recommended_consumers")
    if n is not None:
        return (f"{n} consumer{'' if n == 1 else 's'} (SLO {stats['slo_p99_ms']:g} ms at "
                f"{per_s(stats['arrival_rate_rps'])})")
    if stats.get("slo_p99_ms") is None:
        return f"{NONE} (needs a P99 target: --slo-p99-ms, or the policy's slo_p99_ms)"
    if stats.get("cost_model") is None:
        return f"{NONE} (needs a cost model)"
    return NONE


TENANT_ROWS = 10  # `batchgate stats` shows the busiest tenants; --json has them all


def _tenant_rows(tenants: dict[str, dict[str, Any]], fair: dict[str, Any],
                 counters: dict[str, Any]) -> list[tuple[str, str]]:
    """One row per tenant (busiest first, as stats orders them), beyond TENANT_ROWS the
    rest summed as "other"; a backlogged tenant's share of the weighted service; Jain's
    index over them in the heading."""
    if counters and not counters.get("read", True):
        return [("tenants", f"not read: {counters['fields']:,} counters, over the "
                            f"{counters['read_cap']:,} read (docs/tenants.md)")]
    if not tenants:
        return []
    heading = f"{len(tenants):,}"
    if fair.get("jain_index") is not None:
        heading += (f", {fair['backlogged']:,} backlogged, Jain's index "
                    f"{fair['jain_index']:.3f} (by {fair['unit']})")
    rows = [("tenants", heading + " (docs/tenants.md)")]
    for name, t in top_tenants(tenants, TENANT_ROWS).items():
        share = f", share {t['share']:.1%}" if t.get("share") is not None else ""
        rows.append((f"  {name[:LABEL - 3]}", f"waiting {t['waiting']:,}, in flight "
                     f"{t['in_flight']:,}, served {t['served']:,} (cost "
                     f"{t['served_cost']:,}), rejected {t['rejected']:,}{share}"))
    return rows


def stats_table(stats: dict[str, Any], now_s: float | None = None) -> list[str]:
    """`batchgate stats` for people: label, value (with its unit), one per line, at most
    WIDTH columns; `stats` is what `stats --json` prints."""
    now_s = time.time() if now_s is None else now_s
    depth = stats["depth"]
    waiting = sum(depth.values())
    answered = ", ".join(f"{stats[k]:,} {k}" for k in ("processed", "failed", "expired",
                                                       "cancelled"))
    mean = stats["mean_batch_size"]
    rows: list[tuple[str, str] | list[str] | None] = [
        ("queue", stats["queue"]),
        ("policy", describe_policy(stats["policy"], stats["max_queue_delay_ms_in_use"])),
        ("delay in use", describe_delay(stats["policy"], stats["max_queue_delay_ms_in_use"])),
        None,
        ("waiting", f"{waiting:,} requests (high {depth['high']:,}, normal "
                    f"{depth['normal']:,}, low {depth['low']:,})"),
        ("oldest wait", ms(stats["oldest_wait_ms"]) if waiting else NONE),
        ("past deadline", f"{stats['past_deadline']:,} about to expire, {stats['delayed']:,} "
                          "kept to run when idle"),
        ("in flight", f"{stats['in_flight_requests']:,} requests in "
                      f"{stats['in_flight_batches']:,} batches"),
        ("consumers alive", f"{stats['consumers_alive']:,}"),
        ("arrival rate", f"{per_s(stats['arrival_rate_rps'])} (last "
                         f"{stats.get('arrival_window_s', 10):g} s)"),
        ("answered", answered),
        ("requeued", f"{stats['requeued']:,} (their batch's lease expired)"),
        ("retried", f"{stats.get('retried', 0):,} runs (the model raised a retry_on "
                    f"exception), {stats.get('retrying', 0):,} waiting to run again"),
        ("preempted", f"{stats.get('preempted', 0):,} running requests given back for HIGH "
                      f"work, {stats.get('preempted_steps', 0):,} decode steps to recompute"),
        ("dead letters", f"{stats['dead_letters']:,}"),
        ("batches", f"{stats['batches']:,}" + (f", mean size {mean:.1f} requests"
                                               if mean is not None else "")),
        *_tenant_rows(stats.get("tenants") or {}, stats.get("tenant_fairness") or {},
                      stats.get("tenant_counters") or {}),
        None,
        _latency_rows(stats),
        None,
        ("cost model", _cost_model(stats.get("cost_model"), now_s)),
        ("recommended", _recommended(stats)),
    ]
    lines: list[str] = []
    for row in rows:
        if row is None:
            lines.append("")
        elif isinstance(row, list):
            lines += row
        else:
            label, value = row
            wrapped = textwrap.wrap(value, WIDTH - LABEL) or [""]
            lines.append(f"{label:<{LABEL}}{wrapped[0]}")
            lines += [" " * LABEL + more for more in wrapped[1:]]
    return lines
