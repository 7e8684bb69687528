"""`batchgate consumer --replicas N` / `--devices cuda:0,cuda:1|all`: one supervisor
process runs one plain `batchgate consumer` child per device and replica.

- Each child gets the supervisor's own command line minus --replicas/--devices, plus
  `--device D` (with --devices), `--name NAME-<slot>` (with --name) and
  `--metrics-port PORT+<slot>` (with --metrics-port).
- A child that exits is restarted after an exponential backoff (0.5 s doubling to 30 s;
  the count resets once a child has run for 30 s). A child that exits with status 2 (a
  usage error: bad model, bad flags) stops them all: restarting cannot fix it.
- SIGTERM or SIGINT: the supervisor forwards SIGTERM to every child (each finishes the
  batch in hand), waits up to --stop-timeout seconds, kills what is left, and exits 0.
- Children die with the supervisor (Linux parent-death signal SIGKILL: a supervisor that
  was killed cannot wait for a graceful stop, and a child whose model hangs would ignore
  SIGTERM), so none is orphaned; their batches are re-run as after any crash.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import click

log = logging.getLogger("batchgate.supervisor")

USAGE_ERROR = 2
SUPERVISOR_OPTIONS = ("replicas", "devices", "stop_timeout")
PER_CHILD_OPTIONS = ("device", "name", "metrics_port")


def supervisor_options(func: Any) -> Any:
    options = [
        click.option("--replicas", type=click.IntRange(1, 256), default=1, show_default=True,
                     help="Consumer processes to run (per device with --devices); more than "
                          "one starts a supervisor that restarts any that dies."),
        click.option("--devices", default=None, metavar="cuda:0,cuda:1|all",
                     help="Supervise one consumer per device (x --replicas); `all` = every "
                          "CUDA device torch sees."),
        click.option("--stop-timeout", type=click.FloatRange(0), default=30.0,
                     show_default=True,
                     help="Supervisor: seconds children get to finish after SIGTERM."),
        click.option("--metrics-port", type=click.IntRange(1, 65535), default=None,
                     envvar="BATCHGATE_METRICS_PORT",
                     help="Serve Prometheus metrics on this port at /metrics (needs "
                          "prometheus_client); supervised consumers use PORT, PORT+1, ... "
                          "Env: BATCHGATE_METRICS_PORT."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def wants_supervisor(params: dict[str, Any]) -> bool:
    return params.get("replicas", 1) > 1 or params.get("devices") is not None


def parse_devices(spec: str | None) -> list[str | None]:
    """[None] (no --device) without --devices; `all` asks torch for the CUDA devices."""
    if spec is None:
        return [None]
    if spec.strip().lower() == "all":
        try:
            import torch
        except ImportError:
            raise click.UsageError("--devices all needs torch (pip install "
                                   "'batchgate[torch]')") from None
        count = torch.cuda.device_count()
        if count == 0:
            raise click.UsageError("--devices all: torch sees no CUDA device "
                                   "(torch.cuda.device_count() == 0); check the driver and "
                                   "CUDA_VISIBLE_DEVICES, or use --replicas N on CPU")
        return [f"cuda:{i}" for i in range(count)]
    devices = [d.strip() for d in spec.split(",") if d.strip()]
    if not devices:
        raise click.UsageError(f"--devices {spec!r} names no device")
    return devices


def _option_args(ctx: click.Context, skip: tuple[str, ...]) -> list[str]:
    """The options given on this command line, rebuilt as arguments."""
    args: list[str] = []
    for param in ctx.command.params:
        if not isinstance(param, click.Option) or param.name in skip or param.name is None:
            continue
        if ctx.get_parameter_source(param.name) != click.core.ParameterSource.COMMANDLINE:
            continue  # defaults and environment variables reach the children by themselves
        value, flag = ctx.params[param.name], param.opts[0]
        if param.is_flag:
            if value:
                args.append(flag)
            elif param.secondary_opts:  # --x/--no-x given as --no-x
                args.append(param.secondary_opts[0])
        elif param.multiple:
            for item in value:
                args += [flag, str(item)]
        else:
            args += [flag, str(value)]
    return args


def child_commands(ctx: click.Context) -> list[tuple[str, list[str]]]:
    """(label, argv) of each child, from the supervisor's own command line."""
    params = ctx.params
    if params.get("devices") is not None and params.get("device") is not None:
        raise click.UsageError("give --devices or --device, not both")
    base = [sys.executable, "-m", "batchgate.cli"]
    if ctx.parent is not None and ctx.parent.params.get("log_level"):
        base += ["--log-level", str(ctx.parent.params["log_level"])]
    base += [ctx.info_name or "consumer",
             *_option_args(ctx, SUPERVISOR_OPTIONS + PER_CHILD_OPTIONS)]
    commands = []
    slot = 0
    for listed in parse_devices(params.get("devices")):
        device = listed if listed is not None else params.get("device")
        for _ in range(params.get("replicas", 1)):
            argv = list(base)
            if device is not None:
                argv += ["--device", device]
            if params.get("name"):
                argv += ["--name", f"{params['name']}-{slot}"]
            if params.get("metrics_port"):
                argv += ["--metrics-port", str(params["metrics_port"] + slot)]
            commands.append((f"{slot}" + (f" ({device})" if device else ""), argv))
            slot += 1
    return commands


def _die_with_parent(parent: int) -> None:
    """In the child, before exec: get SIGKILL when the supervisor dies (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class Child:
    label: str
    argv: list[str]
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    failures: int = 0  # consecutive quick deaths
    restart_at: float | None = None


class Supervisor:
    def __init__(self, commands: list[tuple[str, list[str]]], stop_timeout_s: float = 30.0,
                 backoff_base_s: float = 0.5, backoff_cap_s: float = 30.0,
                 stable_s: float = 30.0):
        self.children = [Child(label, argv) for label, argv in commands]
        self.stop_timeout_s = stop_timeout_s
        self.backoff_base_s, self.backoff_cap_s, self.stable_s = (backoff_base_s,
                                                                  backoff_cap_s, stable_s)
        self.stopping = threading.Event()

    def _spawn(self, child: Child) -> None:
        parent = os.getpid()
        child.proc = subprocess.Popen(child.argv, start_new_session=True,
                                      preexec_fn=lambda: _die_with_parent(parent))
        child.started, child.restart_at = time.monotonic(), None
        log.info("consumer %s started (pid %d)", child.label, child.proc.pid)

    def backoff_s(self, failures: int) -> float:
        return min(self.backoff_cap_s, self.backoff_base_s * 2 ** max(0, failures - 1))

    def _check(self, child: Child) -> int | None:
        """Restart `child` if it exited (after its backoff); a usage error is returned."""
        now = time.monotonic()
        if child.restart_at is not None:
            if now >= child.restart_at:
                self._spawn(child)
            return None
        assert child.proc is not None
        code = child.proc.poll()
        if code is None:
            return None
        if code == USAGE_ERROR:
            log.error("consumer %s exited with a usage error (status 2); stopping all",
                      child.label)
            return code
        child.failures = 1 if now - child.started >= self.stable_s else child.failures + 1
        delay = self.backoff_s(child.failures)
        log.warning("consumer %s (pid %d) exited with status %s; restarting in %.1fs",
                    child.label, child.proc.pid, code, delay)
        child.restart_at = now + delay
        return None

    def run(self) -> int:
        """Supervise until SIGTERM/SIGINT; the exit status for the supervisor."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _frame: self._on_signal(signum))
        for child in self.children:
            self._spawn(child)
        click.echo(f"batchgate supervisor (pid {os.getpid()}) running "
                   f"{len(self.children)} consumers", err=True)
        status = 0
        while not self.stopping.wait(0.2):
            for child in self.children:
                code = self._check(child)
                if code is not None:
                    status = code
                    self.stopping.set()
                    break
        self._stop_all()
        return status

    def _on_signal(self, signum: int) -> None:
        log.info("%s: stopping %d consumers", signal.Signals(signum).name, len(self.children))
        self.stopping.set()

    def _stop_all(self) -> None:
        alive = [c.proc for c in self.children if c.proc is not None and c.proc.poll() is None]
        for proc in alive:
            proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + self.stop_timeout_s
        for proc in alive:
            try:
                proc.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("consumer pid %d did not stop in %.0fs; killing it", proc.pid,
                            self.stop_timeout_s)
                proc.kill()
                proc.wait()


def supervise(ctx: click.Context) -> int:
    """Run the children of `batchgate consumer --replicas/--devices`; the exit status."""
    from scheduler_core.admin import ensure_policy
    from scheduler_core.connection import connect
    from scheduler_core.options import policy_values

    commands = child_commands(ctx)
    # A policy conflict would make every child exit at once: report it here, once.
    client = connect(ctx.params["redis_url"])
    try:
        ensure_policy(client, ctx.params["queue"], policy_values(dict(ctx.params)))
    finally:
        client.close()
    return Supervisor(commands, stop_timeout_s=ctx.params.get("stop_timeout", 30.0)).run()
