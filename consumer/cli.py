"""`batchgate consumer`: run one consumer process until SIGTERM/SIGINT."""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
from typing import Any

import click
import orjson

from consumer.loader import load_model
from consumer.sharded import ShardedConsumer
from consumer.supervisor import supervise, supervisor_options, wants_supervisor
from consumer.worker import EXIT_SHARDS_CHANGED, Consumer, ConsumerConfig
from scheduler_core.compat import require_redis_version, usable_cores
from scheduler_core.ops.options import (
    env_option,
    policy_options,
    policy_values,
    queue_option,
    redis_url_option,
    wait_replicas_options,
)
from scheduler_core.policy import MAX_COST_BUCKETS
from scheduler_core.shards import shard_count
from scheduler_core.wire import DEFAULT_MAX_RESULT_BYTES

log = logging.getLogger("batchgate.consumer")
MAX_TORCH_THREADS = 1024


def parse_model_args(pairs: tuple[str, ...]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.isidentifier():
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="--model-arg")
        try:
            kwargs[key] = orjson.loads(raw)
        except orjson.JSONDecodeError:
            kwargs[key] = raw  # plain strings need no quotes
    return kwargs


def install_signal_handlers(consumer: Consumer | ShardedConsumer) -> None:
    def handle(signum: int, _frame: Any) -> None:
        if consumer.stopping.is_set():
            log.warning("second %s: exiting now; the lease sweep re-queues the batch in hand",
                        signal.Signals(signum).name)
            os._exit(128 + signum)
        log.info("%s: finishing the batch in hand, then exiting",
                 signal.Signals(signum).name)
        consumer.stop()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)


@click.command("consumer")
@redis_url_option
@queue_option
@env_option("--model", "model_spec", envvar="BATCHGATE_MODEL",
            default="consumer.models:synthetic", show_default=True,
            help="MODULE:ATTR of a batch model, or of a zero-argument factory returning one.")
@env_option("--model-arg", envvar="BATCHGATE_MODEL_ARG", multiple=True, metavar="KEY=VALUE",
            help="Keyword argument for the model factory (value parsed as JSON if it can "
                 "be). Repeatable; in the variable, pairs separated by spaces.")
@env_option("--device", envvar="BATCHGATE_DEVICE", default=None,
            help="Device for torch models (cpu, cuda:0, ...), passed to the factory as "
                 "device= (the built-in models all take it).")
@env_option("--torch-threads", envvar="BATCHGATE_TORCH_THREADS",
            type=click.IntRange(1, MAX_TORCH_THREADS), default=None,
            help="CPU threads torch (OpenMP/MKL) may use in this process, 1-"
                 f"{MAX_TORCH_THREADS} [default: all cores for a lone consumer; cores / "
                 "consumers under --replicas/--devices; OMP_NUM_THREADS if set].")
@env_option("--lease-ms", envvar="BATCHGATE_LEASE_MS", type=int, default=10_000,
            show_default=True,
            help="ms, 100-86400000: a batch whose lease is not renewed for this long is "
                 "re-queued.")
@env_option("--max-batch-ms", envvar="BATCHGATE_MAX_BATCH_MS", type=int, default=0,
            show_default=True,
            help="ms, 0 or 100-86400000: a batch the model runs longer than this is deemed "
                 "hung: its lease lapses and another consumer re-runs it; lease-ms later, "
                 "unless the model returned, the process exits with status 3 (to be "
                 "restarted). 0 = never.")
@env_option("--max-result-bytes", envvar="BATCHGATE_MAX_RESULT_BYTES",
            type=click.IntRange(16, 512 << 20), default=DEFAULT_MAX_RESULT_BYTES,
            show_default=True,
            help="A result larger than this (encoded) fails its request with InvalidResult.")
@env_option("--overlap/--no-overlap", envvar="BATCHGATE_OVERLAP", default=True,
            show_default=True,
            help="While a backlog waits, fetch the next batch and write the last one's "
                 "results while the model runs. --no-overlap: one batch at a time (a "
                 "crash then re-runs only the batch in hand). In the variable: true/false.")
@env_option("--cost-refit-s", envvar="BATCHGATE_COST_REFIT_S",
            type=click.FloatRange(0, 86_400), default=5.0, show_default=True,
            help="Every this many seconds, refit the queue's stored cost model t(b) = A + "
                 "B·b from the live model times of its batches (0 = never; 0.1-86400).")
@env_option("--prefer-bucket", envvar="BATCHGATE_PREFER_BUCKET",
            type=click.IntRange(0, MAX_COST_BUCKETS + 1), default=0, show_default=True,
            help="With the queue's cost_buckets: the bucket this consumer serves first "
                 "whenever it is due (1 = the cheapest); otherwise the oldest due bucket. "
                 "0 = none.")
@env_option("--only-bucket", envvar="BATCHGATE_ONLY_BUCKET",
            type=click.IntRange(0, MAX_COST_BUCKETS + 1), default=0, show_default=True,
            help="With the queue's cost_buckets: serve this bucket only (1 = the cheapest), "
                 "never another's requests: a consumer dedicated to short (or long) "
                 "requests. 0 = every bucket. Not with --prefer-bucket.")
@wait_replicas_options("Acknowledge a batch's results")
@env_option("--name", envvar="BATCHGATE_CONSUMER_NAME", default="",
            help="Consumer name shown in stats [default: host:pid:random].")
@env_option("--otel-exporter", envvar="BATCHGATE_OTEL_EXPORTER", default="none",
            show_default=True, type=click.Choice(["none", "console"]),
            help="OpenTelemetry spans of each batch (needs the otel extra): console = one "
                 "JSON line per span on stdout; none = to the TracerProvider the model "
                 "module installed, if any, else nowhere.")
@policy_options(env=True)
@supervisor_options
def consumer_command(redis_url: str, queue: str, model_spec: str, model_arg: tuple[str, ...],
                     device: str | None, torch_threads: int | None, lease_ms: int,
                     max_batch_ms: int, max_result_bytes: int, overlap: bool,
                     cost_refit_s: float, prefer_bucket: int, only_bucket: int,
                     wait_replicas: int,
                     wait_timeout_ms: int, name: str, otel_exporter: str,
                     **kwargs: Any) -> None:
    """Pop batches from QUEUE and run MODEL on them until SIGTERM/SIGINT.

    The first consumer of a queue stores its policy; later ones adopt it, and one started
    with conflicting policy flags exits with an error.
    """
    if wants_supervisor(kwargs):  # --replicas N / --devices: one child process each
        raise SystemExit(supervise(click.get_current_context()))
    metrics_port = kwargs.pop("metrics_port", None)
    policy = policy_values(kwargs)
    config = ConsumerConfig(redis_url=redis_url, queue=queue, lease_ms=lease_ms,
                            max_batch_ms=max_batch_ms, max_result_bytes=max_result_bytes,
                            overlap=overlap, cost_refit_s=cost_refit_s, policy=policy,
                            name=name, prefer_bucket=prefer_bucket,
                            only_bucket=only_bucket,
                            wait_replicas=wait_replicas, wait_timeout_ms=wait_timeout_ms)
    model_kwargs = parse_model_args(model_arg)
    flags = dict.fromkeys(model_kwargs, "--model-arg")
    if device is not None:
        model_kwargs["device"], flags["device"] = device, "--device"
    threads = limit_torch_threads(torch_threads)
    if otel_exporter == "console":
        from consumer.tracing import install_console_provider

        try:
            install_console_provider()
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
    # Settle the policy before loading the model: a conflict should fail fast.
    consumer: Consumer | ShardedConsumer = Consumer(model=_unloaded, config=config)
    require_redis_version(consumer.redis)
    if (policy.get("shards") or 1) > 1 or shard_count(consumer.redis, queue) > 1:
        consumer = ShardedConsumer(_unloaded, config, client=consumer.redis)
    consumer.info["device"] = device or ""
    consumer.start()
    install_signal_handlers(consumer)
    if metrics_port:
        from consumer.metrics import serve_metrics

        serve_metrics(consumer, metrics_port)
    consumer.model = load_model(model_spec, model_kwargs, flags)
    limit_torch_threads(threads)  # torch may have been imported by the model only now
    from consumer.tracing import tracer_for

    consumer.tracer = tracer_for(queue)  # after the model, which may install a provider
    if consumer.stopping.is_set():
        return
    freeze_startup_heap()
    click.echo(f"batchgate consumer {config.name} ready on queue {queue!r} (torch threads: "
               f"{threads or os.environ.get('OMP_NUM_THREADS')})", err=True)
    consumer.run()
    if consumer.shards_changed:
        raise SystemExit(EXIT_SHARDS_CHANGED)


def limit_torch_threads(threads: int | None) -> int | None:
    """Cap torch's CPU threads; the number applied (None: OMP_NUM_THREADS, set by the
    user, rules). Consumers sharing a host each default to all cores otherwise, and then
    fight over them: two MiniLM consumers on 2 cores serve less than one."""
    if threads is None:
        if os.environ.get("OMP_NUM_THREADS"):
            return None
        threads = usable_cores()
    # Read by OpenMP and MKL when torch starts; torch already imported is told directly.
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
        log.info("torch threads: %d", threads)
    return threads


def freeze_startup_heap() -> None:
    """Keep the garbage collector off what start-up built (the model, torch's modules).

    A full collection walks every tracked object, and once torch is loaded that is a long
    pause landing in the middle of some batch (docs/benchmarks.md, "Why the consumer
    works the way it does"). Frozen objects are never scanned again; what the loop
    allocates is collected as usual.
    """
    gc.collect()
    gc.freeze()


def _unloaded(payloads: list[Any]) -> list[Any]:
    raise RuntimeError("model not loaded yet")

