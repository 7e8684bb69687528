"""`Consumer`: a consumer in this process, as `batchgate consumer` runs one (the CLI
builds it through this class), for an application that wants to share its loaded model,
GPU context or lifecycle with it:

    from consumer import Consumer

    with Consumer(model, queue="embed", max_batch_size=16):  # serves on a thread
        ...
    Consumer("myapp.models:Embedder", device="cuda:0").run()  # or in the foreground

The keywords are the flags of `batchgate consumer` (consumer/config.py checks both the
same way), and a stop finishes the batches in hand as SIGTERM does (docs/consumer-hosts.md).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import redis

from consumer.config import ConsumerConfig
from consumer.loader import BatchModel, load_model
from consumer.sharded import ShardedConsumer
from consumer.stepwise import is_step_model
from consumer.torch_threads import limit_torch_threads
from consumer.worker import Worker
from scheduler_core.admin import ensure_policy
from scheduler_core.compat import require_redis_version
from scheduler_core.connection import connect
from scheduler_core.errors import InvalidRequest
from scheduler_core.policy import Policy
from scheduler_core.shards import shard_count

log = logging.getLogger("batchgate.consumer")

DEFAULT_MODEL = "consumer.models:synthetic"  # as `batchgate consumer` without --model


class Consumer:
    """One consumer of one queue, its model run in this process.

    model: a batch model (called with a list of payloads, returning a list of results),
    a factory of one (a class, or a function without required arguments, called with
    model_args and device=), or a "MODULE:ATTR" naming either, loaded as --model is.
    config: a ConsumerConfig to start from; keywords override it. Each keyword is a flag
    of `batchgate consumer` (redis_url=, queue=, lease_ms=, strategy=, max_batch_size=,
    ...); a value out of range raises InvalidRequest naming it and its limit, before
    anything is written. client: a redis client to use instead of one for redis_url.
    tracer: an OpenTelemetry Tracer for the batches' spans (default: the global
    TracerProvider's, if one is installed). metrics_registry: a prometheus_client
    CollectorRegistry to record the consumer's metrics into (metrics_port= serves them).
    """

    # How errors name the model and its arguments (the CLI names its flags instead).
    model_fields = {"model": "model", "model_args": "model_args", "device": "device"}

    def __init__(self, model: BatchModel | str = DEFAULT_MODEL,
                 config: ConsumerConfig | None = None, *,
                 model_args: dict[str, Any] | None = None, client: redis.Redis | None = None,
                 tracer: Any = None, metrics_registry: Any = None, **settings: Any):
        self.config = ConsumerConfig.build(config, **settings)
        if not isinstance(model, str) and not callable(model) and not is_step_model(model):
            raise InvalidRequest(self.model_fields["model"], f"{model!r} is neither a batch "
                                 "model, a factory of one nor a 'MODULE:ATTR' string")
        self.model_args = dict(model_args or {})
        bad = [key for key in self.model_args if not isinstance(key, str)
               or not key.isidentifier()]
        if bad:
            raise InvalidRequest(self.model_fields["model_args"],
                                 f"keys must be argument names, got {bad[0]!r}")
        self.model: BatchModel | None = None  # the loaded model, once prepared
        self.loop: Worker | ShardedConsumer | None = None  # made by prepare()
        self.metrics: Any = None  # consumer.metrics.ConsumerMetrics, with a registry or port
        # Set by stop() (or the loop itself): the loop finishes what it holds and leaves.
        self.stopping = threading.Event()
        self._model_given, self._client = model, client
        self._tracer, self._registry = tracer, metrics_registry
        self._server: Any = None  # the metrics HTTP server
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._ran = False  # run() was called (a consumer runs once)
        self._running = False

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def policy(self) -> Policy | None:
        """The queue's policy this consumer applies (None before prepare())."""
        return self.loop.policy if self.loop is not None else None

    @property
    def shards_changed(self) -> bool:
        """The queue's shard count changed while running: the loop stopped, to be started
        again (the CLI exits with status 4 for its supervisor to restart it)."""
        return self.loop is not None and self.loop.shards_changed

    # -- lifecycle ------------------------------------------------------------------
    def prepare(self) -> Policy:
        """Connect, check the Redis version, settle the queue's policy (PolicyConflict if
        this consumer's differs; before the model loads, so that a conflict fails fast),
        then load the model. run() and start() do it first; calling it ahead separates
        the start-up's errors from the serving."""
        with self._lock:
            if self.loop is None:
                self.loop = self._build()
            assert self.loop.policy is not None
            return self.loop.policy

    def _build(self) -> Worker | ShardedConsumer:
        config = self.config
        client = self._client or connect(config.redis_url)
        require_redis_version(client)
        policy = ensure_policy(client, config.queue, config.policy)
        sharded = policy.shards > 1 or shard_count(client, config.queue) > 1
        if sharded and config.batching == "continuous":
            raise InvalidRequest("batching", f"queue {config.queue!r} is sharded; "
                                             "continuous batching serves an unsharded queue "
                                             "only: use --batching static")
        if config.otel_exporter != "none":
            from consumer.tracing import install_console_provider, install_otlp_provider

            try:
                if config.otel_exporter == "otlp":
                    install_otlp_provider(config.otel_endpoint)
                else:
                    install_console_provider()
            except ValueError as exc:
                raise InvalidRequest("otel_exporter", str(exc)) from None
        self.model = self._load_model()
        tracer = self._batch_tracer()  # after the model, which may install a provider
        if self._registry is not None or config.metrics_port:
            from consumer.metrics import ConsumerMetrics

            self.metrics = ConsumerMetrics(config.queue, client, self._registry)
        kind = ShardedConsumer if sharded else Worker
        loop = kind(self.model, config, client=client, tracer=tracer, observer=self.metrics)
        loop.stopping = self.stopping
        loop.prepare()
        if self.metrics is not None:
            from consumer.metrics import DelayCollector, PreemptionCollector, serve_metrics

            self.metrics.registry.register(DelayCollector(loop))
            if config.preempt:
                self.metrics.registry.register(PreemptionCollector(loop))
            if config.metrics_port:
                try:
                    self._server = serve_metrics(self.metrics.registry, config.metrics_port)
                except OSError as exc:  # in use, or a privileged port
                    raise InvalidRequest("metrics_port", f"cannot serve on port "
                                         f"{config.metrics_port}: {exc.strerror}") from None
        return loop

    def _load_model(self) -> BatchModel:
        kwargs, names = dict(self.model_args), self.model_fields
        flags = dict.fromkeys(kwargs, names["model_args"])
        if self.config.device is not None:
            kwargs["device"], flags["device"] = self.config.device, names["device"]
        limit_torch_threads(self.config.torch_threads)
        model = load_model(self._model_given, kwargs, flags, field=names["model"])
        limit_torch_threads(self.config.torch_threads)  # torch may be imported only now
        return model

    def _batch_tracer(self) -> Any:
        from consumer.tracing import BatchTracer, tracer_for

        if self._tracer is not None:
            return BatchTracer(self.config.queue, self._tracer)
        return tracer_for(self.config.queue)

    def run(self) -> None:
        """Serve the queue until stop() (from another thread or a signal handler):
        blocking. Prepares first if prepare() was not called. A consumer runs once."""
        with self._lock:
            if self._ran:
                raise RuntimeError(f"consumer {self.name} runs once: make a new Consumer")
            self._ran = self._running = True
        try:
            self.prepare()
            assert self.loop is not None
            if not self.stopping.is_set():
                self.loop.run()
        finally:
            self._close_server()
            self._running = False

    def _close_server(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def start(self) -> Consumer:
        """Prepare here (start-up errors raise in the caller), then run() on a daemon
        thread; returns the consumer. stop() ends it."""
        thread = threading.Thread(target=self._run_thread, name=f"consumer-{self.name}",
                                  daemon=True)
        with self._lock:  # claimed before the slow prepare: a racing start() is refused
            if self._thread is not None:
                raise RuntimeError(f"consumer {self.name} was started already")
            self._thread = thread
        try:
            self.prepare()
        except BaseException:
            self._thread = None  # nothing runs: a later start() may try again
            raise
        thread.start()
        return self

    def _run_thread(self) -> None:
        try:
            self.run()
        except BaseException as exc:  # re-raised by stop(), so that it is not lost
            log.exception("consumer %s stopped on an error", self.name)
            self._error = exc

    def stop(self, timeout: float | None = None) -> bool:
        """Stop serving, as SIGTERM stops `batchgate consumer`: no new batch is taken;
        the batches this consumer holds (the one the model runs, one popped ahead) are
        run, their results written, and it leaves the queue's consumer list. After
        start(), wait up to `timeout` s (default: stop_timeout) for that; True once the
        loop has ended, False while a batch is still running (it keeps finishing on its
        thread; if the process exits first, its lease lapses and another consumer runs
        it again: nothing is lost). Returns at once when called from a signal handler
        or the loop's own thread. Raises the error the loop's thread ended with, if any.
        """
        self.stopping.set()
        thread = self._thread
        if thread is None and not self._ran:
            self._close_server()  # prepared, never run: what prepare() opened
        if thread is None or thread is threading.current_thread() or thread.ident is None:
            return not self._running  # (not started yet: a start() still preparing)
        thread.join(self.config.stop_timeout if timeout is None else timeout)
        if thread.is_alive():
            log.warning("consumer %s: still finishing its batch after the stop timeout",
                        self.name)
            return False
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return True

    def __enter__(self) -> Consumer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
