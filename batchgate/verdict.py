"""What a demo or benchmark met: one line per check, the host's load beside each MISS
(a loaded host misses latency targets for reasons of its own), and one summary line."""

from __future__ import annotations

import os
from typing import Any

from scheduler_core.compat import usable_cores


def host_load() -> dict[str, Any]:
    """The host's 1-minute load average and the cores this process may use."""
    return {"load_1m": round(os.getloadavg()[0], 2), "cores": usable_cores()}


def load_text(host: dict[str, Any]) -> str:
    return f"host load {host['load_1m']:.1f} on {host['cores']} core(s)"


def summary(checks: list[dict[str, Any]], host: dict[str, Any]) -> str:
    """`summary: N of M checks met` (and the host's load when one was missed)."""
    met = sum(1 for c in checks if c["ok"])
    line = f"summary: {met} of {len(checks)} checks met"
    return line if met == len(checks) else f"{line} ({load_text(host)})"


def check_lines(checks: list[dict[str, Any]], host: dict[str, Any]) -> list[str]:
    """`- PASS: check: value` per check (a MISS with the host's load), then the summary."""
    lines = [f"- PASS: {c['check']}: {c['value']}" if c["ok"] else
             f"- MISS: {c['check']}: {c['value']} ({load_text(host)})" for c in checks]
    return [*lines, summary(checks, host)]


def missed(checks: list[dict[str, Any]]) -> int:
    return sum(1 for c in checks if not c["ok"])
