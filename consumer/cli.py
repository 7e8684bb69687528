"""`batchgate consumer`: run one consumer process until SIGTERM/SIGINT."""

from __future__ import annotations

import gc
import logging
import os
import signal
from typing import Any

import click
import orjson

from consumer.api import DEFAULT_MODEL, Consumer
from consumer.config import BATCHING_MODES, INT_RANGES, OFF_OR_RANGES, OTEL_EXPORTERS
from consumer.supervisor import (
    SUPERVISOR_ONLY,
    supervise,
    supervisor_options,
    wants_supervisor,
)
from consumer.torch_threads import default_torch_threads
from consumer.worker import EXIT_SHARDS_CHANGED
from scheduler_core.ops.options import (
    env_option,
    policy_options,
    queue_option,
    redis_url_option,
    wait_replicas_options,
)
from scheduler_core.wire import DEFAULT_MAX_RESULT_BYTES

log = logging.getLogger("batchgate.consumer")
# The ranges the help states; consumer/config.py checks them, for the API too.
RESULT_BYTES = INT_RANGES["max_result_bytes"]
BUCKETS = INT_RANGES["prefer_bucket"]
THREADS = INT_RANGES["torch_threads"]
REFIT = OFF_OR_RANGES["cost_refit_s"]


class CliConsumer(Consumer):
    """The CLI's consumer: errors about the model name the flags typed."""

    model_fields = {"model": "--model", "model_args": "--model-arg", "device": "--device"}


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
@env_option("--model", "model_spec", envvar="BATCHGATE_MODEL",
            default=DEFAULT_MODEL, show_default=True,
            help="MODULE:ATTR of a batch model, or of a zero-argument factory returning one.")
@env_option("--model-arg", envvar="BATCHGATE_MODEL_ARG", multiple=True, metavar="KEY=VALUE",
            help="Keyword argument for the model factory (value parsed as JSON if it can "
                 "be). Repeatable; in the variable, pairs separated by spaces.")
@env_option("--device", envvar="BATCHGATE_DEVICE", default=None,
            help="Device for torch models (cpu, cuda:0, ...), passed to the factory as "
                 "device= (the built-in models all take it).")
@env_option("--torch-threads", envvar="BATCHGATE_TORCH_THREADS", type=int, default=None,
            help="CPU threads torch (OpenMP/MKL) may use in this process, "
                 f"{THREADS[0]}-{THREADS[1]} [default: all cores for a lone consumer; cores / "
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
@env_option("--max-result-bytes", envvar="BATCHGATE_MAX_RESULT_BYTES", type=int,
            default=DEFAULT_MAX_RESULT_BYTES, show_default=True,
            help=f"Bytes, {RESULT_BYTES[0]}-{RESULT_BYTES[1]}: a result larger than this "
                 "(encoded) fails its request with InvalidResult.")
@env_option("--overlap/--no-overlap", envvar="BATCHGATE_OVERLAP", default=True,
            show_default=True,
            help="While a backlog waits, fetch the next batch and write the last one's "
                 "results while the model runs. --no-overlap: one batch at a time (a "
                 "crash then re-runs only the batch in hand). In the variable: true/false.")
@env_option("--batching", envvar="BATCHGATE_BATCHING", default="static", show_default=True,
            type=click.Choice(BATCHING_MODES),
            help="static: the model runs each popped batch to its end. continuous: a "
                 "step-wise model (docs/models.md); requests join the running batch "
                 "between steps, up to max_batch_size sequences (and max_batch_cost), and "
                 "each is answered as soon as it finishes (docs/scheduling.md).")
@env_option("--preempt/--no-preempt", envvar="BATCHGATE_PREEMPT", default=False,
            show_default=True,
            help="With --batching continuous: when HIGH requests wait and every slot runs, "
                 "give running LOW sequences back to the queue (they keep their place and "
                 "are recomputed later; a stream gets a restart marker). In the variable: "
                 "true/false.")
@env_option("--cost-refit-s", envvar="BATCHGATE_COST_REFIT_S", type=float, default=5.0,
            show_default=True,
            help="Every this many seconds, refit the queue's stored cost model t(b) = A + "
                 f"B·b from the live model times of its batches (0 = never; "
                 f"{REFIT[0]}-{REFIT[1]}).")
@env_option("--prefer-bucket", envvar="BATCHGATE_PREFER_BUCKET", type=int, default=0,
            show_default=True,
            help=f"{BUCKETS[0]}-{BUCKETS[1]}. With the queue's cost_buckets: the bucket "
                 "this consumer serves first "
                 "whenever it is due (1 = the cheapest); otherwise the oldest due bucket. "
                 "0 = none.")
@env_option("--only-bucket", envvar="BATCHGATE_ONLY_BUCKET", type=int, default=0,
            show_default=True,
            help=f"{BUCKETS[0]}-{BUCKETS[1]}. With the queue's cost_buckets: serve this "
                 "bucket only (1 = the cheapest), "
                 "never another's requests: a consumer dedicated to short (or long) "
                 "requests. 0 = every bucket. Not with --prefer-bucket.")
@wait_replicas_options("Acknowledge a batch's results", ranged=False)
@env_option("--name", envvar="BATCHGATE_CONSUMER_NAME", default="",
            help="Consumer name shown in stats [default: host:pid:random].")
@env_option("--otel-exporter", envvar="BATCHGATE_OTEL_EXPORTER", default="none",
            show_default=True, type=click.Choice(OTEL_EXPORTERS),
            help="OpenTelemetry spans of each batch (needs the otel extra): console = one "
                 "JSON line per span on stdout; otlp = to a collector over OTLP/HTTP "
                 "(--otel-endpoint); none = to the TracerProvider the model module "
                 "installed, if any, else nowhere.")
@env_option("--otel-endpoint", envvar="BATCHGATE_OTEL_ENDPOINT", default=None,
            metavar="URL",
            help="With --otel-exporter otlp: the collector's OTLP/HTTP URL, e.g. "
                 "http://collector:4318 (/v1/traces is added to a URL without a path) "
                 "[default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT, "
                 "else http://localhost:4318/v1/traces].")
@policy_options(env=True)
@supervisor_options
def consumer_command(model_spec: str, model_arg: tuple[str, ...], torch_threads: int | None,
                     **settings: Any) -> None:
    """Pop batches from QUEUE and run MODEL on them until SIGTERM/SIGINT.

    The first consumer of a queue stores its policy; later ones adopt it, and one started
    with conflicting policy flags exits with an error.
    """
    process = {name: settings.pop(name) for name in SUPERVISOR_ONLY}
    if torch_threads is None:
        torch_threads = default_torch_threads()
    # Every setting is checked here (the supervisor's children's too), before anything
    # is written.
    consumer = CliConsumer(model_spec, model_args=parse_model_args(model_arg),
                           torch_threads=torch_threads, **settings)
    if wants_supervisor(process):  # --replicas N / --devices: one child process each
        raise SystemExit(supervise(click.get_current_context()))
    install_signal_handlers(consumer)
    consumer.prepare()  # a policy conflict fails before the model loads
    if consumer.stopping.is_set():
        return
    freeze_startup_heap()
    click.echo(f"batchgate consumer {consumer.name} ready on queue {consumer.config.queue!r} "
               f"(torch threads: {torch_threads or os.environ.get('OMP_NUM_THREADS')})",
               err=True)
    consumer.run()
    if consumer.shards_changed:
        raise SystemExit(EXIT_SHARDS_CHANGED)


def freeze_startup_heap() -> None:
    """Keep the garbage collector off what start-up built (the model, torch's modules).

    A full collection walks every tracked object, and once torch is loaded that is a long
    pause landing in the middle of some batch (docs/benchmarks.md, "Why the consumer
    works the way it does"). Frozen objects are never scanned again; what the loop
    allocates is collected as usual.
    """
    gc.collect()
    gc.freeze()
