"""Bulk jobs on RQ (needs the `rq` extra). The job function is `producer.bulk.rq_jobs.run_job`;
an RQ worker runs it:

    rq worker -w rq.worker.SimpleWorker --url redis://127.0.0.1:6379/0 batchgate-bulk

SimpleWorker runs jobs in the worker process itself (no fork per job); that suits long
jobs that hold a Producer. The job records its progress in the RQ job's meta (state,
done, total, errors, rate, eta_s) and in its checkpoint (`producer.bulk.state`).

A job whose worker died is resumed from its checkpoint by `resume` (`batchgate bulk
resume JOB_ID`) at once, or by RQ itself when it notices the abandoned job (after the
job's heartbeat lapses, about a minute or more) while the job has retries left.
"""

from __future__ import annotations

from typing import Any

import redis
from rq import Queue, Retry, get_current_job
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus

from producer.bulk.engine import BulkSpec, run_bulk
from producer.bulk.state import BulkError, BulkState, StateStore
from scheduler_core.connection import connect, parse_topology
from scheduler_core.errors import InvalidRequest

RQ_QUEUE = "batchgate-bulk"
RESULT_TTL_S = 7 * 86_400
JOB_FUNC = "producer.bulk.rq_jobs.run_job"


def run_job(spec: dict[str, Any]) -> dict[str, Any]:
    """The RQ job: run (or resume) the bulk job, mirroring progress into job.meta."""
    job = get_current_job()

    def report(state: BulkState) -> None:
        if job is not None:
            job.meta.update(state.progress())
            job.save_meta()

    return run_bulk(BulkSpec.from_dict(spec), report=report).progress()


def rq_connection(url: str) -> redis.Redis:
    """RQ's connection (raw bytes replies, no decode_responses). Sentinel: the current
    primary's client. RQ has no Redis Cluster support: `bulk run` serves that case."""
    topology = parse_topology(url)
    if topology is None:
        return redis.Redis.from_url(url)
    if topology.kind == "cluster":
        raise InvalidRequest("redis_url", "RQ (bulk submit/resume) does not run on Redis "
                             "Cluster; run the job with `batchgate bulk run` instead")
    return connect(url)


def submit_job(spec: BulkSpec, rq_queue: str = RQ_QUEUE, job_timeout_s: int = 86_400,
               retries: int = 3, total: int = 0) -> Job:
    queue = Queue(rq_queue, connection=rq_connection(spec.redis_url))
    return queue.enqueue(
        JOB_FUNC, spec.to_dict(), job_id=spec.job_id, job_timeout=job_timeout_s,
        result_ttl=RESULT_TTL_S, failure_ttl=RESULT_TTL_S,
        retry=Retry(max=retries) if retries else None,
        description=f"batchgate bulk {spec.input} -> {spec.output}",
        meta={"state": "queued", "done": 0, "total": total, "errors": 0, "rate": 0.0})


def fetch_job(redis_url: str, job_id: str) -> Job | None:
    topology = parse_topology(redis_url)
    if topology is not None and topology.kind == "cluster":
        return None  # no RQ there: a job run by `bulk run` has only its own state
    try:
        return Job.fetch(job_id, connection=rq_connection(redis_url))
    except NoSuchJobError:
        return None


def resume_job(redis_url: str, job_id: str) -> str:
    """Put a stopped bulk job back on its RQ queue; returns what was done."""
    job = fetch_job(redis_url, job_id)
    if job is None:
        raise BulkError(f"no RQ job {job_id!r} (finished jobs are kept {RESULT_TTL_S}s); "
                        "resubmit it with `batchgate bulk submit --job-id`")
    status = job.get_status()
    if status in (JobStatus.FINISHED,):
        return "finished already"
    if status in (JobStatus.QUEUED, JobStatus.SCHEDULED, JobStatus.DEFERRED):
        return f"{status.value} already"
    store = StateStore(job.connection, job_id)
    if store.running():
        raise BulkError(f"job {job_id} is running (its lease is held); a run whose worker "
                        "died loses its lease within lease_s seconds")
    if status == JobStatus.FAILED:
        job.requeue()
        return "requeued"
    # STARTED with a dead worker (or stopped/canceled): drop the stale execution so RQ's
    # abandoned-job cleanup does not fail the resumed run, then enqueue it again.
    registry = job.started_job_registry
    with job.connection.pipeline() as pipe:
        if hasattr(registry, "remove_executions"):  # rq >= 2: one entry per execution
            registry.remove_executions(job, pipeline=pipe)
        else:
            registry.remove(job, pipeline=pipe)
        pipe.execute()
    Queue(job.origin, connection=job.connection).enqueue_job(job)
    return "requeued"
