"""`batchgate consumer`: run one consumer process until SIGTERM/SIGINT."""

from __future__ import annotations

import gc
import logging
import os
import signal
from typing import Any

import click
import orjson

from consumer.loader import load_model
from consumer.supervisor import supervise, supervisor_options, wants_supervisor
from consumer.worker import Consumer, ConsumerConfig
from scheduler_core.options import policy_options, policy_values, queue_option, redis_url_option
from scheduler_core.wire import DEFAULT_MAX_RESULT_BYTES

log = logging.getLogger("batchgate.consumer")


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


def install_signal_handlers(consumer: Consumer) -> None:
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
@click.option("--model", "model_spec", default="consumer.models:synthetic", show_default=True,
              help="MODULE:ATTR of a batch model, or of a zero-argument factory returning one.")
@click.option("--model-arg", multiple=True, metavar="KEY=VALUE",
              help="Keyword argument for the model factory (value parsed as JSON if it can "
                   "be). Repeatable.")
@click.option("--device", default=None,
              help="Device for torch models (cpu, cuda:0, ...), passed to the factory.")
@click.option("--lease-ms", type=int, default=10_000, show_default=True,
              help="A batch whose lease is not renewed for this long is re-queued.")
@click.option("--max-batch-ms", type=int, default=0, show_default=True,
              help="A batch the model runs longer than this is deemed hung: its lease "
                   "lapses and another consumer re-runs it; lease-ms later, unless the "
                   "model returned, the process exits with status 3 (to be restarted). "
                   "0 = never.")
@click.option("--max-result-bytes", type=click.IntRange(16, 512 << 20),
              default=DEFAULT_MAX_RESULT_BYTES, show_default=True,
              help="A result larger than this (encoded) fails its request with InvalidResult.")
@click.option("--overlap/--no-overlap", default=True, show_default=True,
              help="While a backlog waits, fetch the next batch and write the last one's "
                   "results while the model runs. --no-overlap: one batch at a time (a "
                   "crash then re-runs only the batch in hand).")
@click.option("--name", default="", help="Consumer name [default: host:pid:random].")
@policy_options
@supervisor_options
def consumer_command(redis_url: str, queue: str, model_spec: str, model_arg: tuple[str, ...],
                     device: str | None, lease_ms: int, max_batch_ms: int,
                     max_result_bytes: int, overlap: bool, name: str, **kwargs: Any) -> None:
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
                            overlap=overlap, policy=policy, name=name)
    model_kwargs = parse_model_args(model_arg)
    if device is not None:
        model_kwargs["device"] = device
    # Settle the policy before loading the model: a conflict should fail fast.
    consumer = Consumer(model=_unloaded, config=config)
    consumer.start()
    install_signal_handlers(consumer)
    if metrics_port:
        from consumer.metrics import serve_metrics

        serve_metrics(consumer, metrics_port)
    consumer.model = load_model(model_spec, model_kwargs)
    if consumer.stopping.is_set():
        return
    freeze_startup_heap()
    click.echo(f"batchgate consumer {config.name} ready on queue {queue!r}", err=True)
    consumer.run()


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

