"""`batchgate consumer --replicas N` / `--devices cuda:0,cuda:1|all`: one supervisor
process runs one plain `batchgate consumer` child per device and replica.

- Each child gets the supervisor's own command line minus --replicas/--devices, plus
  `--device D` (with --devices), `--name NAME-<slot>` (with --name) and
  `--metrics-port PORT+<slot>` (with --metrics-port).
- Restarts follow systemd's `Restart=on-failure`: a child that fails (exits non-zero, or
  is killed by a signal other than SIGTERM/SIGINT/SIGHUP/SIGPIPE) is restarted after an
  exponential backoff (0.5 s doubling to 30 s; the count resets once a child has run for
  30 s). A child that stops cleanly (status 0, e.g. after its own SIGTERM, or killed by
  one of those signals) is not restarted; once every child has stopped cleanly the
  supervisor exits 0. A child that exits with status 2 (a usage error: bad model, bad
  flags) stops them all: restarting cannot fix it.
- A child's heartbeat entry is removed from the queue as soon as the supervisor sees it
  die, so `consumers_alive` drops at once instead of seconds later.
- Without --torch-threads, each child gets the host's cores divided by the children.
- SIGTERM or SIGINT: the supervisor forwards SIGTERM to every child (each finishes the
  batch in hand), waits up to --stop-timeout seconds, kills what is left, and exits 0.
- Children die with the supervisor (scheduler_core/lifetime.py: Linux parent-death signal
  SIGKILL), so none is orphaned; their batches are re-run as after any crash.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click

from scheduler_core.compat import usable_cores
from scheduler_core.lifetime import spawn
from scheduler_core.ops.options import env_option

log = logging.getLogger("batchgate.supervisor")

USAGE_ERROR = 2
SUPERVISOR_OPTIONS = ("replicas", "devices", "stop_timeout")
# The options of a supervisor only: an in-process consumer (consumer/api.py) has no
# keyword for them (it is one consumer; stop_timeout is its stop()'s wait).
SUPERVISOR_ONLY = ("replicas", "devices")
PER_CHILD_OPTIONS = ("device", "name", "metrics_port", "torch_threads")
# Children are plain consumers: the variables that would make each one a supervisor too
# are not passed on.
SUPERVISOR_ENV = ("BATCHGATE_REPLICAS", "BATCHGATE_DEVICES", "BATCHGATE_STOP_TIMEOUT")
# A child ended by one of these stopped cleanly (systemd's Restart=on-failure agrees).
CLEAN_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE)


def supervisor_options(func: Any) -> Any:
    options = [
        env_option("--replicas", envvar="BATCHGATE_REPLICAS", type=click.IntRange(1, 256),
                   default=1, show_default=True,
                   help="Consumer processes to run, 1-256 (per device with --devices); more "
                        "than one starts a supervisor that restarts any that fails."),
        env_option("--devices", envvar="BATCHGATE_DEVICES", default=None,
                   metavar="cuda:0,cuda:1|all",
                   help="Supervise one consumer per device (x --replicas); `all` = every "
                        "CUDA device torch sees."),
        env_option("--stop-timeout", envvar="BATCHGATE_STOP_TIMEOUT", type=float,
                   default=30.0, show_default=True,
                   help="Supervisor: seconds children get to finish after SIGTERM, "
                        "0-86400."),
        env_option("--metrics-port", envvar="BATCHGATE_METRICS_PORT", type=int,
                   default=None,
                   help="1-65535: serve Prometheus metrics on this port at /metrics (needs "
                        "prometheus_client); supervised consumers use PORT, PORT+1, ..."),
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
    devices = parse_devices(params.get("devices"))
    children = len(devices) * params.get("replicas", 1)
    # Each child would otherwise take every core, and they would fight over them.
    threads = params.get("torch_threads") or max(1, usable_cores() // children)
    commands = []
    slot = 0
    for listed in devices:
        device = listed if listed is not None else params.get("device")
        for _ in range(params.get("replicas", 1)):
            argv = [*base, "--torch-threads", str(threads)]
            if device is not None:
                argv += ["--device", device]
            if params.get("name"):
                argv += ["--name", f"{params['name']}-{slot}"]
            if params.get("metrics_port"):
                argv += ["--metrics-port", str(params["metrics_port"] + slot)]
            commands.append((f"{slot}" + (f" ({device})" if device else ""), argv))
            slot += 1
    return commands


@dataclass
class Child:
    label: str
    argv: list[str]
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    failures: int = 0  # consecutive quick deaths
    restart_at: float | None = None
    stopped: bool = False  # stopped cleanly: not restarted

    @property
    def consumer_name(self) -> str | None:
        """The --name it was given (None: the consumer's default, host:pid:random)."""
        return self.argv[self.argv.index("--name") + 1] if "--name" in self.argv else None


def stopped_cleanly(code: int) -> bool:
    """As systemd's Restart=on-failure sees it: exit status 0, or a clean signal."""
    return code == 0 or -code in CLEAN_SIGNALS


class Supervisor:
    def __init__(self, commands: list[tuple[str, list[str]]], stop_timeout_s: float = 30.0,
                 backoff_base_s: float = 0.5, backoff_cap_s: float = 30.0,
                 stable_s: float = 30.0, on_exit: Callable[[Child], None] | None = None):
        self.children = [Child(label, argv) for label, argv in commands]
        self.stop_timeout_s = stop_timeout_s
        self.backoff_base_s, self.backoff_cap_s, self.stable_s = (backoff_base_s,
                                                                  backoff_cap_s, stable_s)
        self.stopping = threading.Event()
        self.on_exit = on_exit  # called once per child that died, before any restart
        self.env = {k: v for k, v in os.environ.items() if k not in SUPERVISOR_ENV}

    def _spawn(self, child: Child) -> None:
        child.proc = spawn(child.argv, start_new_session=True, env=self.env)
        child.started, child.restart_at = time.monotonic(), None
        log.info("consumer %s started (pid %d)", child.label, child.proc.pid)

    def backoff_s(self, failures: int) -> float:
        return min(self.backoff_cap_s, self.backoff_base_s * 2 ** max(0, failures - 1))

    def _check(self, child: Child) -> int | None:
        """Restart `child` if it failed (after its backoff); a usage error is returned."""
        now = time.monotonic()
        if child.stopped:
            return None
        if child.restart_at is not None:
            if now >= child.restart_at:
                self._spawn(child)
            return None
        assert child.proc is not None
        code = child.proc.poll()
        if code is None:
            return None
        if self.on_exit is not None:
            self.on_exit(child)
        if stopped_cleanly(code):
            log.info("consumer %s (pid %d) stopped cleanly (status %s); not restarting it",
                     child.label, child.proc.pid, code)
            child.stopped = True
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
            if all(child.stopped for child in self.children):
                log.info("every consumer stopped cleanly; the supervisor exits")
                break
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
    import redis

    from scheduler_core.admin import ensure_policy
    from scheduler_core.compat import connect_checked
    from scheduler_core.keys import QueueKeys
    from scheduler_core.ops.options import policy_values

    commands = child_commands(ctx)
    # A policy conflict (or an old Redis) would make every child exit at once: report it
    # here, once.
    client = connect_checked(ctx.params["redis_url"])
    try:
        ensure_policy(client, ctx.params["queue"], policy_values(dict(ctx.params)))
        keys = QueueKeys(ctx.params["queue"])

        def forget_heartbeat(child: Child) -> None:
            """A dead child's heartbeat would count it alive for seconds more."""
            try:
                name = child.consumer_name
                if name is None and child.proc is not None:
                    pattern = f"{socket.gethostname()}:{child.proc.pid}:*"
                    name = next((m for m, _ in client.zscan_iter(keys.consumers,
                                                                 match=pattern)), None)
                if name is not None:
                    client.zrem(keys.consumers, name)
            except redis.RedisError as exc:  # it ages out by itself
                log.debug("cannot remove the heartbeat of consumer %s: %s", child.label, exc)

        return Supervisor(commands, stop_timeout_s=ctx.params.get("stop_timeout", 30.0),
                          on_exit=forget_heartbeat).run()
    finally:
        client.close()
