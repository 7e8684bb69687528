"""A bulk job's state in Redis: its checkpoint (and progress) and the lease that keeps two
runs of one job from writing the same output file.

| key                           | type   | holds                                              |
|-------------------------------|--------|----------------------------------------------------|
| `batchgate:bulk:<job>`        | hash   | spec, epoch, input fingerprint, next_line,         |
|                               |        | out_bytes, progress; expires 7 days after the end  |
| `batchgate:bulk:<job>:lease`  | string | token of the run writing the output; expires unless |
|                               |        | renewed (a killed run's lease lapses in lease_s)   |
"""

from __future__ import annotations

import contextlib
import re
import secrets
import threading
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import redis

from scheduler_core.errors import BatchgateError, InvalidRequest
from scheduler_core.keys import bulk_lease_key as lease_key
from scheduler_core.keys import bulk_state_key as state_key
from scheduler_core.scripts import Scripts, bulk_lease_keys

JOB_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # fullmatch: `$` matches before a final "\n"
FINISHED_TTL_S = 7 * 86_400


class BulkError(BatchgateError):
    """A bulk job cannot run: bad input or output, changed input, or already running."""


def check_job_id(job_id: str) -> str:
    if not isinstance(job_id, str) or not JOB_ID.fullmatch(job_id):
        raise InvalidRequest("job_id", f"{job_id!r}: use 1-64 letters, digits, '_', '.', '-'")
    return job_id


def count_records(path: Path) -> int:
    """The records a job's output will hold: the input's non-blank lines (a trailing
    blank line, or one in the middle, gets no record, so it is not counted)."""
    with path.open("rb") as f:
        return sum(1 for line in f if line.strip())


def fingerprint(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size}:{st.st_mtime_ns}"


@dataclass
class BulkState:
    """One bulk job as stored in `batchgate:bulk:<job>` (all values are strings there)."""

    job_id: str
    input: str
    output: str
    queue: str
    priority: str
    window: int
    epoch: str  # part of every idempotency key: a restarted job never reuses old requests
    input_fingerprint: str
    total: int  # records the output will hold: the input's non-blank lines
    next_line: int = 1  # first input line without a record in the output (1-based)
    out_bytes: int = 0  # output size at the checkpoint
    records: int = 0  # records written (ok and error)
    errors: int = 0  # error records written
    state: str = "queued"  # queued | running | done | failed
    error: str = ""  # why the last run failed
    runs: int = 0  # runs started (1 + resumes)
    created_at: float = 0.0
    run_started_at: float = 0.0
    run_start_line: int = 1
    run_start_records: int = 0
    updated_at: float = 0.0
    finished_at: float = 0.0

    @property
    def done(self) -> int:
        """Records written, out of `total`."""
        return self.records

    @property
    def rate(self) -> float:
        """Records per second over the current (or last) run."""
        end = self.finished_at or self.updated_at
        elapsed = end - self.run_started_at
        done = self.records - self.run_start_records
        return done / elapsed if self.run_started_at and elapsed > 0 and done > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        if self.state == "done":
            return 0.0
        rate = self.rate
        return (self.total - self.done) / rate if rate > 0 else None

    def progress(self) -> dict[str, Any]:
        """What `bulk status` shows and an RQ job's meta holds."""
        return {"state": self.state, "done": self.done, "total": self.total,
                "errors": self.errors, "rate": round(self.rate, 2), "eta_s": self.eta_s,
                "runs": self.runs, "error": self.error, "output": self.output}

    def to_redis(self) -> dict[str, str]:
        return {k: str(v) for k, v in asdict(self).items()}

    @classmethod
    def from_redis(cls, raw: dict[bytes, bytes]) -> BulkState:
        data = {k.decode(): v.decode() for k, v in raw.items()}
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in data:
                kind = f.type if isinstance(f.type, str) else f.type.__name__
                values[f.name] = {"int": int, "float": float}.get(kind, str)(data[f.name])
        return cls(**values)


class StateStore:
    def __init__(self, client: redis.Redis, job_id: str):
        self.client = client
        self.job_id = check_job_id(job_id)
        self.key = state_key(job_id)

    def load(self) -> BulkState | None:
        raw = self.client.hgetall(self.key)
        return BulkState.from_redis(raw) if raw else None

    def save(self, job: BulkState, /, **changes: Any) -> BulkState:
        """Apply `changes` to `job` and store it."""
        for name, value in changes.items():
            setattr(job, name, value)
        job.updated_at = time.time()
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(self.key, mapping=job.to_redis())
        if job.state in ("done", "failed"):
            pipe.expire(self.key, FINISHED_TTL_S)
        else:
            pipe.persist(self.key)
        pipe.execute()
        return job

    def mark_failed(self, error: str) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(self.key, mapping={"state": "failed", "error": error[:2000],
                                     "updated_at": str(time.time())})
        pipe.expire(self.key, FINISHED_TTL_S)
        pipe.execute()

    def delete(self) -> None:
        self.client.delete(self.key)

    def running(self) -> bool:
        """Whether a run holds the job's lease now."""
        return bool(self.client.exists(lease_key(self.job_id)))


def new_epoch() -> str:
    return secrets.token_hex(3)


class Lease:
    """Exclusive right to run one bulk job, renewed by a thread; lapses `ttl_s` after its
    holder dies. `acquire` waits up to `wait_s` for a dead holder's lease to lapse."""

    def __init__(self, client: redis.Redis, job_id: str, ttl_s: float):
        if not 1 <= ttl_s <= 3600:
            raise InvalidRequest("lease_s", f"{ttl_s} is outside [1, 3600]")
        self.client, self.key, self.ttl_ms = client, lease_key(job_id), int(ttl_s * 1000)
        self._scripts, self._keys = Scripts(client), bulk_lease_keys(job_id)
        self.token = secrets.token_hex(8)
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self, wait_s: float) -> None:
        end = time.monotonic() + wait_s
        while not self.client.set(self.key, self.token, nx=True, px=self.ttl_ms):
            if time.monotonic() >= end:
                left = self.client.pttl(self.key)
                raise BulkError(f"bulk job is already running (its lease {self.key} is held"
                                f" for another {max(left, 0) / 1000:.1f}s)")
            time.sleep(min(0.2, self.ttl_ms / 4000))
        self._thread = threading.Thread(target=self._renew, name="bulk-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_ms / 3000):
            try:
                if not self._scripts.bulk_lease_renew(keys=self._keys,
                                                      args=[self.token, self.ttl_ms]):
                    self.lost.set()
                    return
            except redis.RedisError:
                continue  # retried next period; the lease lasts ttl_s

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with contextlib.suppress(redis.RedisError):  # else it lapses by itself
            self._scripts.bulk_lease_release(keys=self._keys, args=[self.token])
