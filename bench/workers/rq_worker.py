"""One RQ `SimpleWorker` process for the RQ baseline (no fork per job; the model is loaded
once, before the worker starts). Queues are listened to in the order given, which is RQ's
own priority mechanism (high, normal, low). Per-job logging is set to WARNING so that
writing a log line per job does not count against RQ."""

from __future__ import annotations

import argparse

import orjson
import redis
from rq import Queue, SimpleWorker

from bench.workers import rq_jobs
from bench.workers.gate import guard_parent, ready_then_wait


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--queues", required=True, help="comma-separated, highest first")
    parser.add_argument("--model", required=True)
    parser.add_argument("--model-args", default="{}")
    parser.add_argument("--name", default=None)
    parser.add_argument("--go", required=True, help="start-gate list key")
    args = parser.parse_args()
    guard_parent()
    rq_jobs.load(args.model, orjson.loads(args.model_args))
    connection = redis.Redis.from_url(args.redis_url)
    queues = [Queue(name, connection=connection) for name in args.queues.split(",")]
    worker = SimpleWorker(queues, connection=connection, name=args.name)
    ready_then_wait(args.redis_url, args.go)
    worker.work(logging_level="WARNING")


if __name__ == "__main__":
    main()
