"""Bulk jobs: a JSONL file through the queue, checkpointed in Redis, optionally on RQ."""
