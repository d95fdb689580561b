"""Prometheus metrics shared by the three services: the tiers' metrics (TierMetrics), per-rpc latency and
errors (RpcMetrics, and a gRPC server interceptor that feeds it), and a /metrics endpoint on its own
port (serve_metrics). No torch here: the coordinator uses this module too.

Every service object owns its own prometheus_client.CollectorRegistry (never the global default), so
several services in one process (the tests) do not collide. Names follow vLLM's where vLLM has the
metric (`vllm:` prefix, label `model_name`; see docs/metrics.md); specdec's own start with `specdec_`.
No label ever carries a session id.

Wiring a tier (the engine and servicers are the tier owner's; a few lines each):

    registry = CollectorRegistry()
    metrics = TierMetrics(registry, "target", config.tier.model.path, load=engine.load)
    create_server([...], config.server, interceptors=[RpcMetricsInterceptor(metrics.observe_rpc)])
    # in the engine, once per batched forward:
    metrics.observe_step(num_sessions=len(batch), num_tokens=tokens_in_batch, seconds=forward_s)
    # in the entry point, while serving:
    server = serve_metrics(registry, args.metrics_address)   # ... server.close() on shutdown
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler, make_server

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, ThreadingWSGIServer, generate_latest, make_wsgi_app
from prometheus_client.registry import Collector

from specdec.serving.auth import bearer_failure

log = logging.getLogger(__name__)

# vLLM's label for the served model; used on every series (vllm: and specdec_) for one dashboard variable.
MODEL_LABEL = "model_name"
TIERS = ("draft", "target")

# Bucket boundaries.
RPC_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
STEP_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# vLLM's vllm:iteration_tokens_total buckets (tokens per engine step).
BATCH_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class LoadReading(Protocol):
    """What a tier's load callback returns, read at scrape time (any object with these attributes)."""

    num_sessions: int  # live sessions in the KV store
    cached_tokens: int  # tokens held in all sessions' KV caches
    evictions: int  # sessions evicted so far (LRU, idle TTL, capacity), not counting EndSession; monotonic
    num_running: int  # sessions in the batch being computed now
    num_waiting: int  # requests queued for the next batch
    kv_used_bytes: int  # KV cache memory in use
    kv_capacity_bytes: int  # KV cache memory the tier may use (0 = unknown)
    kv_resident_bytes: int  # memory the KV pool occupies now
    # Optional (read with getattr, 0 when absent): the prefix cache's counters, tokens, monotonic.
    # prefix_cache_queries: int  # tokens of full sends looked up in it
    # prefix_cache_hits: int  # of them, tokens it supplied instead of a forward
    # inline_steps: int  # steps a lone session ran on the tier's event loop (--inline-steps), monotonic


@dataclass(frozen=True)
class LoadSnapshot:
    """A ready-made LoadReading for engines that prefer returning a plain value."""

    num_sessions: int = 0
    cached_tokens: int = 0
    evictions: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_used_bytes: int = 0
    kv_capacity_bytes: int = 0
    kv_resident_bytes: int = 0


class RpcMetrics:
    """specdec_rpc_duration_seconds{..., rpc} and specdec_rpc_errors_total{..., rpc, code} for one service.
    const_labels: the service's fixed labels, e.g. {"model_name": m} or {"model_name": m, "tier": "draft"}."""

    def __init__(self, registry: CollectorRegistry, const_labels: dict[str, str]) -> None:
        names = list(const_labels)
        self._values = [const_labels[n] for n in names]
        self.duration = Histogram("specdec_rpc_duration_seconds", "Time to serve one rpc (streams: until the stream ends), seconds.",
                                  [*names, "rpc"], registry=registry, buckets=RPC_SECONDS_BUCKETS)
        self.errors = Counter("specdec_rpc_errors", "Rpcs (or HTTP requests) that ended with an error, by status code.",
                              [*names, "rpc", "code"], registry=registry)

    def observe(self, rpc: str, code: str, seconds: float) -> None:
        """code: a gRPC status name ("OK", "INVALID_ARGUMENT", ...) or an HTTP status ("200", "429", ...)."""
        self.duration.labels(*self._values, rpc).observe(seconds)
        if code not in ("OK", "200"):
            self.errors.labels(*self._values, rpc, code).inc()


class TierMetrics:
    """Everything a draft or target tier exports. `load` (or set_load later) is called at every scrape."""

    def __init__(self, registry: CollectorRegistry, tier: str, model_name: str,
                 load: Callable[[], LoadReading] | None = None, cache_info: dict[str, str] | None = None) -> None:
        """cache_info: the KV cache's configuration, exported as vllm:cache_config_info's labels (as vLLM
        exports its CacheConfig: values as strings, plus engine="0")."""
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
        ProcessCollector(registry=registry)  # process_resident_memory_bytes, process_cpu_seconds_total, ...
        self.registry = registry
        self.tier = tier
        self.model_name = model_name
        labels = {MODEL_LABEL: model_name, "tier": tier}
        self.rpc = RpcMetrics(registry, labels)
        names, values = list(labels), list(labels.values())
        self._batch_size = Histogram("specdec_tier_batch_size", "Sessions in one batched forward.", names,
                                     registry=registry, buckets=BATCH_SIZE_BUCKETS).labels(*values)
        self._batch_tokens = Histogram("specdec_tier_batch_tokens", "Tokens in one batched forward.", names,
                                       registry=registry, buckets=BATCH_TOKENS_BUCKETS).labels(*values)
        self._step_seconds = Histogram("specdec_tier_step_seconds", "Time of one batched forward, seconds.", names,
                                       registry=registry, buckets=STEP_SECONDS_BUCKETS).labels(*values)
        # vLLM's name for the tokens of one engine step (here: one batched forward of this tier)
        self._iteration_tokens = Histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                           names, registry=registry, buckets=BATCH_TOKENS_BUCKETS).labels(*values)
        info = {"engine": "0", **(cache_info or {})}
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", [*names, *info], registry=registry,
              ).labels(*values, *info.values()).set(1)
        self._load_collector = _LoadCollector(labels, load)
        registry.register(self._load_collector)

    def set_load(self, load: Callable[[], LoadReading] | None) -> None:
        """The callback read at scrape time (from the metrics server's thread: keep it cheap and thread-safe)."""
        self._load_collector.load = load

    def observe_step(self, num_sessions: int, num_tokens: int, seconds: float) -> None:
        """One batched forward over num_sessions sessions and num_tokens tokens that took `seconds`."""
        self._batch_size.observe(num_sessions)
        self._batch_tokens.observe(num_tokens)
        self._iteration_tokens.observe(num_tokens)
        self._step_seconds.observe(seconds)

    def observe_rpc(self, method: str, code_name: str, seconds: float) -> None:
        """One served rpc: method ("Verify", "ProposeStream", ...), its status name ("OK", ...), its duration."""
        self.rpc.observe(method, code_name, seconds)

    def interceptor(self) -> "RpcMetricsInterceptor":
        return RpcMetricsInterceptor(self.observe_rpc)


class _LoadCollector(Collector):
    """Reads a tier's load at scrape time: vLLM's scheduler gauges plus specdec's session-store ones."""

    def __init__(self, labels: dict[str, str], load: Callable[[], LoadReading] | None) -> None:
        self.names = list(labels)
        self.values = list(labels.values())
        self.load = load

    def describe(self):
        return []  # dynamic: nothing is checked at registration

    def collect(self):
        if self.load is None:
            return
        try:
            s = self.load()
        except Exception:  # a scrape must not fail because the engine is busy or shutting down
            log.debug("tier load callback failed", exc_info=True)
            return
        gauges = [
            ("vllm:num_requests_running", "Number of requests in model execution batches.", s.num_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             s.kv_used_bytes / s.kv_capacity_bytes if s.kv_capacity_bytes > 0 else 0.0),
            ("specdec_tier_sessions", "Live sessions in the tier's KV store.", s.num_sessions),
            ("specdec_tier_cached_tokens", "Tokens held in all sessions' KV caches.", s.cached_tokens),
            ("specdec_tier_queue_depth", "Requests queued for the next batch (= vllm:num_requests_waiting).", s.num_waiting),
            ("specdec_tier_kv_used_bytes", "KV cache memory in use, bytes.", s.kv_used_bytes),
            ("specdec_tier_kv_capacity_bytes", "KV cache memory the tier may use, bytes (0 = unknown).", s.kv_capacity_bytes),
            ("specdec_tier_kv_resident_bytes", "Memory the KV pool occupies now, bytes (CPU: the positions ever written; "
             "GPU: all of it).", s.kv_resident_bytes),
        ]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=self.names)
            g.add_metric(self.values, float(value))
            yield g
        for name, doc, attr in (
                ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", "prefix_cache_queries"),
                ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", "prefix_cache_hits")):
            counter = CounterMetricFamily(name, doc, labels=self.names)
            counter.add_metric(self.values, float(getattr(s, attr, 0)))
            yield counter
        c = CounterMetricFamily("specdec_tier_evictions", "Sessions evicted (LRU, idle TTL, capacity), not counting EndSession.",
                                labels=self.names)
        c.add_metric(self.values, float(s.evictions))
        yield c
        c = CounterMetricFamily("specdec_tier_inline_steps", "Steps a lone session ran on the tier's event loop, not "
                                "handed to its engine thread (--inline-steps).", labels=self.names)
        c.add_metric(self.values, float(getattr(s, "inline_steps", 0)))
        yield c


# --- per-rpc metrics from a gRPC server interceptor ---------------------------------------------------

# Health checks and reflection are not the service's work; they would drown the rpc histograms.
UNOBSERVED_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class RpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    """Calls observe(rpc, code_name, seconds) once per rpc, whatever its shape, when it ends (OK, aborted,
    failed or cancelled). Put it first in the interceptor list so that it also sees calls that later
    interceptors refuse (e.g. UNAUTHENTICATED from the bearer-token check)."""

    def __init__(self, observe: Callable[[str, str, float], None], unobserved: tuple[str, ...] = UNOBSERVED_PREFIXES) -> None:
        self._observe = observe
        self._unobserved = unobserved

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or method.startswith(self._unobserved):
            return handler
        rpc = method.rsplit("/", 1)[-1]
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(self._unary(rpc, handler.unary_unary),
                                                       handler.request_deserializer, handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(self._unary(rpc, handler.stream_unary),
                                                        handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(self._stream(rpc, handler.unary_stream),
                                                        handler.request_deserializer, handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(self._stream(rpc, handler.stream_stream),
                                                     handler.request_deserializer, handler.response_serializer)

    def _finish(self, rpc: str, context, t0: float, error: BaseException | None) -> None:
        try:
            self._observe(rpc, _code_name(context, error), time.perf_counter() - t0)
        except Exception:  # metrics must never break an rpc
            log.exception("rpc metrics")

    @contextlib.contextmanager
    def _observed(self, rpc: str, context):
        """Time one call of `rpc` and record its outcome, whatever it is."""
        t0, error = time.perf_counter(), None
        try:
            yield
        except BaseException as e:
            error = e
            raise
        finally:
            self._finish(rpc, context, t0, error)

    def _unary(self, rpc: str, behavior):
        async def wrapped(request, context):
            with self._observed(rpc, context):
                return await behavior(request, context)

        return wrapped

    def _stream(self, rpc: str, behavior):
        async def wrapped(request, context):
            with self._observed(rpc, context):
                if inspect.isasyncgenfunction(behavior):
                    responses = behavior(request, context)
                    try:
                        async for response in responses:
                            yield response
                    finally:
                        await responses.aclose()  # runs the handler's clean-up now, even when we are cancelled at a yield
                else:  # a coroutine that writes with context.write()
                    await behavior(request, context)

        return wrapped


def _code_name(context, error: BaseException | None) -> str:
    import asyncio

    if isinstance(error, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED.name
    code = _context_code(context)
    if code is not None and code != grpc.StatusCode.OK:
        return code.name
    if error is not None and not isinstance(error, grpc.aio.AbortError):
        return grpc.StatusCode.UNKNOWN.name
    return grpc.StatusCode.OK.name if code is None else code.name


def _context_code(context: Any) -> grpc.StatusCode | None:
    try:
        code = context.code()
    except Exception:
        return None
    if isinstance(code, grpc.StatusCode):
        return code
    if isinstance(code, int):  # some grpcio versions report the raw integer
        return next((c for c in grpc.StatusCode if c.value[0] == code), None)
    return None


# --- the /metrics endpoint --------------------------------------------------------------------------


# The exposition every /metrics serves: Prometheus' text format 0.0.4, whatever the scraper asks for.
# prometheus_client 0.26 writes OpenMetrics sample names with `:` turned into `_` (vllm:x -> vllm_x, while
# HELP/TYPE keep the colon: prometheus/client_python#1177), and Prometheus asks for OpenMetrics first, so
# a negotiated scrape would store none of the vllm: names the dashboards query. The text format keeps them.
METRICS_CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4


def exposition(registry: CollectorRegistry) -> bytes:
    """`registry` in the text format 0.0.4 (METRICS_CONTENT_TYPE)."""
    return generate_latest(registry)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # scrapes are not worth a log line each
        pass


class MetricsServer:
    """A registry served at http://address/metrics from a daemon thread (independent of the event loop,
    so a scrape is answered even while the service is busy), in the text format (see METRICS_CONTENT_TYPE)."""

    def __init__(self, registry: CollectorRegistry, address: str, token: str | None = None) -> None:
        """token: set = a scrape needs 'authorization: Bearer <token>' (the public API's token), else 401."""
        host, port = split_address(address)
        app = make_wsgi_app(registry)
        secret = token.encode() if token else None

        def text_format(environ, start_response):  # no OpenMetrics: the encoder falls back to text 0.0.4
            failure = bearer_failure(environ.get("HTTP_AUTHORIZATION"), secret, "header") if secret else None
            if failure is not None:
                start_response("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"),
                                                    ("WWW-Authenticate", "Bearer")])
                return [failure.encode()]
            return app({**environ, "HTTP_ACCEPT": ""}, start_response)

        class Server(ThreadingWSGIServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        self._httpd = make_server(host, port, text_format, Server, handler_class=_QuietHandler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="metrics", daemon=True)
        self._thread.start()
        self.host = host
        self.port: int = self._httpd.server_port

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)


def serve_metrics(registry: CollectorRegistry, address: str | None, token: str | None = None) -> MetricsServer | None:
    """Serve `registry` on address ("host:port"; port 0 = any free port); None or "" = no endpoint. token:
    set = scrapes need it as a bearer token."""
    if not address:
        return None
    server = MetricsServer(registry, address, token)
    log.info("metrics on %s", server.url)
    return server


def split_address(address: str) -> tuple[str, int]:
    """'host:port' (also '[::1]:port' and ':port') -> (host, port); ValueError on anything else."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected host:port, got {address!r}")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)
