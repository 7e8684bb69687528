"""Offline bulk jobs: a JSONL file through a queue at LOW priority, results in input order.

A bulk job streams INPUT.jsonl (one JSON payload per line) and submits the lines through a
`ShardedProducer` with at most `window` requests outstanding, so it never floods the queue: with
the `priority` strategy online (HIGH) requests never wait behind more than the batch in
hand. It writes one record per input line to OUTPUT.jsonl, in input order:

    {"line": 7, "ok": true, "result": <the model's result>}
    {"line": 8, "ok": false, "error": {"type": "RequestFailed", "message": "..."}}

Blank lines get no record. A line that is not JSON, or that the model fails on, gets an
error record: it never stops the job.

Checkpoints and resume: every `checkpoint_s` the job flushes and fsyncs the output, then
stores {next line, output size} in Redis (`producer.bulk.state`). A job that starts again
(its RQ worker was killed and the job requeued, or `bulk run` run again) truncates the
output to the checkpoint and goes on from the next line. Every line is submitted with the
idempotency key `bulk:<job>:<epoch>:<line>`: a line that was in flight when the job died
resolves to the request already queued (or to its stored result), so the model runs once
per line and no record is written twice.

On a sharded queue (docs/scaling.md) each line goes to the shard its idempotency key
hashes to, so the lines spread over the shards and a resumed run finds its lines' requests
in the same shards (as long as the shard count is unchanged).

Run it with RQ (`producer.bulk.rq_jobs`, `batchgate bulk submit`) or in the foreground
(`batchgate bulk run`).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from producer.bulk.state import (
    BulkError,
    BulkState,
    Lease,
    StateStore,
    check_job_id,
    count_records,
    fingerprint,
    new_epoch,
)
from producer.sharded import ShardedProducer
from producer.sync import Handle
from scheduler_core.connection import DEFAULT_REDIS_URL, connect
from scheduler_core.errors import InvalidRequest, QueueFull, RequestFailed, RequestLost
from scheduler_core.keys import QueueKeys
from scheduler_core.policy import Priority

log = logging.getLogger("batchgate.bulk")

DEFAULT_WINDOW = 64
MAX_WINDOW = 10_000
WAIT_STEP_S = 1.0  # a result not arrived in this long: check the request is still known
MAX_GENERATIONS = 3  # resubmissions of a line whose request vanished (result expired)
Report = Callable[[BulkState], None]


@dataclass(frozen=True)
class BulkSpec:
    """What a bulk job does. Paths are absolute: the job may run on another host."""

    job_id: str
    input: str
    output: str
    redis_url: str = DEFAULT_REDIS_URL
    queue: str = "default"
    priority: str = "low"
    window: int = DEFAULT_WINDOW
    lease_s: float = 10.0  # a killed run's job can be resumed this long after it died
    checkpoint_s: float = 1.0

    def __post_init__(self) -> None:
        check_job_id(self.job_id)
        QueueKeys(self.queue)
        object.__setattr__(self, "priority", Priority.parse(self.priority).name.lower())
        if isinstance(self.window, bool) or not isinstance(self.window, int) \
                or not 1 <= self.window <= MAX_WINDOW:
            raise InvalidRequest("window", f"{self.window!r} is outside [1, {MAX_WINDOW}]")
        for name in ("input", "output"):
            object.__setattr__(self, name, str(Path(getattr(self, name)).resolve()))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BulkSpec:
        return cls(**data)


def default_job_id(input_path: str, output_path: str) -> str:
    """`bulk run`'s job id: the same paths resume the same job."""
    key = f"{Path(input_path).resolve()}\0{Path(output_path).resolve()}".encode()
    return "run-" + hashlib.sha1(key).hexdigest()[:16]


def check_paths(spec: BulkSpec, store: StateStore, overwrite: bool) -> None:
    """Refuse a missing input, or an output that exists and is not this job's."""
    if not Path(spec.input).is_file():
        raise BulkError(f"input {spec.input} is not a readable file")
    if not Path(spec.output).parent.is_dir():
        raise BulkError(f"output directory {Path(spec.output).parent} does not exist")
    if Path(spec.output).exists() and store.load() is None and not overwrite:
        raise BulkError(f"output {spec.output} exists; pass --overwrite to replace it")


def create_state(store: StateStore, spec: BulkSpec) -> BulkState:
    path = Path(spec.input)
    state = BulkState(job_id=spec.job_id, input=spec.input, output=spec.output,
                      queue=spec.queue, priority=spec.priority, window=spec.window,
                      epoch=new_epoch(), input_fingerprint=fingerprint(path),
                      total=count_records(path), created_at=time.time())
    return store.save(state)


@dataclass
class _Slot:
    line: int
    payload: Any = None
    record: dict[str, Any] | None = None  # known without the model (bad line, error)
    handle: Handle | None = None
    generation: int = 0
    skip: bool = False  # blank line: no record


def _error(line: int, kind: str, message: str) -> dict[str, Any]:
    return {"line": line, "ok": False, "error": {"type": kind, "message": message}}


class BulkRunner:
    def __init__(self, spec: BulkSpec, report: Report | None = None):
        self.spec = spec
        self.report = report
        self.client = connect(spec.redis_url)
        self.store = StateStore(self.client, spec.job_id)
        self.state: BulkState | None = None
        self.producer: ShardedProducer | None = None

    # -- the run --------------------------------------------------------------------
    def run(self) -> BulkState:
        lease = Lease(self.client, self.spec.job_id, self.spec.lease_s)
        lease.acquire(wait_s=self.spec.lease_s * 1.5)
        try:
            state = self.store.load() or create_state(self.store, self.spec)
            self.state = state
            if state.state == "done":  # e.g. RQ re-ran a job that had finished
                self._report()
                return state
            if fingerprint(Path(state.input)) != state.input_fingerprint:
                raise BulkError(f"input {state.input} changed since the job was created; "
                                "start a new job (bulk run --restart)")
            now = time.time()
            self.store.save(state, state="running", error="", runs=state.runs + 1,
                            run_started_at=now, run_start_line=state.next_line,
                            run_start_records=state.records)
            log.info("bulk %s: %s from line %d (%d of %d records done)", state.job_id,
                     "resuming" if state.next_line > 1 else "starting", state.next_line,
                     state.records, state.total)
            with ShardedProducer(self.spec.redis_url, self.spec.queue) as self.producer, \
                    _open_output(Path(state.output), state.out_bytes) as out:
                self._loop(state, out, lease)
            self.store.save(state, state="done", finished_at=time.time())
            self._report()
            return state
        except BaseException as exc:
            if self.state is not None and self.state.state == "running":
                # Only these fields: the in-memory position may be past the checkpoint.
                self.store.mark_failed(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            lease.release()
            self.client.close()

    def _loop(self, state: BulkState, out: BinaryIO, lease: Lease) -> None:
        window, chunk = self.spec.window, max(1, self.spec.window // 4)
        pending: deque[_Slot] = deque()
        next_checkpoint = time.monotonic() + self.spec.checkpoint_s
        with open(state.input, "rb") as f:
            lines = _numbered(f, state.next_line)
            exhausted = False
            while True:
                head_ready = bool(pending) and self._ready(pending[0])
                room = window - len(pending)
                if not exhausted and room and (room >= chunk or not head_ready):
                    exhausted = self._fill(pending, lines, room)
                if not pending:
                    break
                slot = pending.popleft()
                record = None if slot.skip else self._record(slot)
                if lease.lost.is_set():
                    raise BulkError("lost the job's lease (another run took it over)")
                if record is not None:
                    out.write(orjson.dumps(record) + b"\n")
                    state.records += 1
                    state.errors += not record["ok"]
                state.next_line = slot.line + 1
                if time.monotonic() >= next_checkpoint:
                    self._checkpoint(state, out)
                    next_checkpoint = time.monotonic() + self.spec.checkpoint_s
        self._checkpoint(state, out)

    def _checkpoint(self, state: BulkState, out: BinaryIO) -> None:
        out.flush()
        os.fsync(out.fileno())
        self.store.save(state, out_bytes=out.tell())
        self._report()

    def _report(self) -> None:
        if self.report is not None and self.state is not None:
            self.report(self.state)

    # -- submitting -----------------------------------------------------------------
    def _fill(self, pending: deque[_Slot], lines: Iterator[tuple[int, bytes]],
              room: int) -> bool:
        """Read up to `room` lines into `pending`, submitting the valid ones; True at EOF."""
        fresh: list[_Slot] = []
        read = 0
        for number, raw in itertools.islice(lines, room):
            read += 1
            slot = _Slot(number)
            if not raw.strip():
                slot.skip = True
            else:
                try:
                    slot.payload = orjson.loads(raw)
                except orjson.JSONDecodeError as exc:
                    slot.record = _error(number, "InvalidInput", f"line is not JSON: {exc}")
            pending.append(slot)
            if not slot.skip and slot.record is None:
                fresh.append(slot)
        if fresh:
            self._submit(fresh)
        return read < room

    def _key(self, slot: _Slot) -> str:
        assert self.state is not None
        key = f"bulk:{self.spec.job_id}:{self.state.epoch}:{slot.line}"
        return f"{key}:g{slot.generation}" if slot.generation else key

    def _submit(self, slots: list[_Slot]) -> None:
        assert self.producer is not None
        try:
            handles = self._enqueue([s.payload for s in slots], [self._key(s) for s in slots])
        except InvalidRequest:  # one bad payload fails the call: submit one by one
            for slot in slots:
                try:
                    slot.handle = self._enqueue([slot.payload], [self._key(slot)])[0]
                except InvalidRequest as exc:
                    slot.record = _error(slot.line, "InvalidRequest", str(exc))
            return
        for slot, handle in zip(slots, handles, strict=True):
            slot.handle = handle

    def _enqueue(self, payloads: list[Any], keys: list[str | None]) -> list[Handle]:
        assert self.producer is not None
        while True:
            try:
                return self.producer.submit_many(payloads, self.spec.priority,
                                                 idempotency_keys=keys)
            except QueueFull as exc:  # back off: the queue is for online traffic first
                if len(payloads) > exc.limit:
                    raise BulkError(f"--window {self.spec.window} is larger than the queue's "
                                    f"max_queue_size {exc.limit}: lower it") from None
                time.sleep(min(5.0, max(0.2, exc.retry_after_s or 0.5)))

    # -- results --------------------------------------------------------------------
    @staticmethod
    def _ready(slot: _Slot) -> bool:
        return slot.skip or slot.record is not None or (slot.handle is not None
                                                        and slot.handle.done())

    def _record(self, slot: _Slot) -> dict[str, Any]:
        timeout = 0.0  # first look: a resubmitted line's result may be stored already
        while slot.record is None:
            assert slot.handle is not None
            try:
                value = slot.handle.result(timeout=timeout)
                slot.record = {"line": slot.line, "ok": True, "result": value}
            except RequestLost:  # vanished, as the producer found (see _vanished)
                self._resubmit(slot)
                timeout = WAIT_STEP_S
            except RequestFailed as exc:
                message = str(exc).removeprefix(
                    f"request {exc.request_id} failed: {exc.error_type}: ")
                slot.record = _error(slot.line, exc.error_type, message)
            except TimeoutError:
                if self._vanished(slot.handle.id):
                    self._resubmit(slot)
                timeout = WAIT_STEP_S
        return slot.record

    def _vanished(self, request_id: str) -> bool:
        """Neither waiting, nor running, nor answered: its result expired before we read it
        (a job resumed long after it died) or its queue was flushed. One MULTI, so a
        request moving between these states is seen in one of them: per shard, as a
        request never moves between shards."""
        assert self.producer is not None
        for producer in self.producer:
            keys = producer.keys
            pipe = self.client.pipeline(transaction=True)
            for key in keys.pending_all:
                pipe.zscore(key, request_id)
            pipe.hexists(keys.owner, request_id)
            pipe.exists(keys.result(request_id))
            if any(pipe.execute()):
                return False
        return True

    def _resubmit(self, slot: _Slot) -> None:
        slot.generation += 1
        if slot.generation > MAX_GENERATIONS:
            slot.record = _error(slot.line, "Lost", "the request vanished from the queue "
                                 f"{MAX_GENERATIONS} times (results expired or queue flushed)")
            return
        log.warning("bulk %s: line %d's request vanished; submitting it again",
                    self.spec.job_id, slot.line)
        self._submit([slot])


def _numbered(f: BinaryIO, first: int) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) from line `first` on (1-based)."""
    return itertools.islice(enumerate(f, start=1), first - 1, None)


class _open_output:
    """The output file opened for appending after its checkpoint: truncated to
    `out_bytes` (records written after the last checkpoint are written again)."""

    def __init__(self, path: Path, out_bytes: int):
        self.path, self.out_bytes = path, out_bytes
        self.file: BinaryIO | None = None

    def __enter__(self) -> BinaryIO:
        if self.out_bytes == 0:
            self.file = self.path.open("wb")
            return self.file
        size = self.path.stat().st_size if self.path.exists() else -1
        if size < self.out_bytes:
            raise BulkError(f"output {self.path} is shorter ({size} bytes) than its checkpoint"
                            f" ({self.out_bytes} bytes): was it moved or edited?")
        self.file = self.path.open("r+b")
        self.file.truncate(self.out_bytes)
        self.file.seek(self.out_bytes)
        return self.file

    def __exit__(self, *exc: object) -> None:
        if self.file is not None:
            self.file.close()


def run_bulk(spec: BulkSpec, report: Report | None = None) -> BulkState:
    """Run (or resume) a bulk job to the end in this process; returns its final state."""
    return BulkRunner(spec, report).run()
