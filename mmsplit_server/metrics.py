"""Prometheus metrics of both services (`--metrics-port`, off by default):
`/metrics` over plain HTTP from a thread of the service's process.

Names follow Prometheus conventions: `mmsplit_<service>_...`, units in the
name, `_total` counters. Every label takes values from a bounded set
(`outcome`: OK, an ErrorCode name or CANCELLED; a worker's `stage`, a
scheduler `backend`, a `rank`, a collector `generation`), never a request
id. Gauges are read when scraped, from the service's own state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from mmsplit_server import gcheap

# A scraper sends its whole request at once: one that has sent nothing more
# for this long is cut off (each connection holds a thread of its own).
READ_TIMEOUT_S = 10.0

Labels = str | tuple[str, ...]  # a labelled metric's label name, or names

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServiceMetrics:
    """Per-request metrics of one service, and its gauges and counters read
    on scrape."""

    def __init__(self, service: str, *, read_timeout_s: float = READ_TIMEOUT_S) -> None:
        self.read_timeout_s = read_timeout_s
        self.registry = CollectorRegistry()
        self._servers: list[WSGIServer] = []
        self.prefix = prefix = f"mmsplit_{service}"
        r = self.registry
        self.requests = Counter(
            f"{prefix}_requests", "Finished requests by outcome (OK, an ErrorCode, CANCELLED)", ["outcome"], registry=r
        )
        self.duration = Histogram(
            f"{prefix}_request_duration_seconds", "Time from a request's arrival to its end", buckets=LATENCY_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            f"{prefix}_time_to_first_token_seconds", "Time from a request's arrival to its first token",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(f"{prefix}_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.completion_tokens = Counter(f"{prefix}_completion_tokens", "Tokens generated", registry=r)
        # A scheduler's: the tokenizers' searches' steps, kept out of the request metrics.
        self.search_steps = (
            Counter(
                f"{prefix}_search_steps",
                "Steps of a tokenizer's search (beam search: one token of one beam) by outcome; not in the requests'",
                ["outcome"],
                registry=r,
            )
            if service == "scheduler"
            else None
        )
        pauses = gcheap.Pauses().install()  # for the process's life: metrics are made once, at start-up
        self.counter_by(
            "gc_collections", "Python garbage collections by generation", "generation", lambda: pauses.collections
        )
        self.counter_by(
            "gc_pause_seconds",
            "Seconds the Python garbage collector held the process (the GIL), by generation",
            "generation",
            lambda: pauses.seconds,
        )
        self.gauge(
            "gc_frozen_objects",
            "Objects frozen out of the garbage collector's reach at start-up",
            gcheap.frozen_objects,
        )

    def finished(self, outcome: str, duration_s: float, ttft_s: float | None, prompt: int, completion: int) -> None:
        self.requests.labels(outcome=outcome).inc()
        self.duration.observe(duration_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        self.prompt_tokens.inc(prompt)
        self.completion_tokens.inc(completion)

    def histogram(self, name: str, documentation: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
        return Histogram(f"{self.prefix}_{name}", documentation, buckets=buckets, registry=self.registry)

    def gauge(self, name: str, documentation: str, read: Callable[[], float]) -> None:
        Gauge(f"{self.prefix}_{name}", documentation, registry=self.registry).set_function(read)

    def counters(self, read: Callable[[], dict[str, tuple[str, float]]]) -> None:
        """Counters kept elsewhere (name -> (documentation, value)), read on scrape."""
        self.registry.register(_Read(self.prefix, read))

    def counter_by(self, name: str, documentation: str, label: Labels, read: Callable[[], Mapping[Any, float]]) -> None:
        """A counter kept elsewhere with bounded labels, read on scrape: one
        label name (label value -> count), or a tuple of them (a tuple of
        values -> count)."""
        self.registry.register(_ReadLabelled(f"{self.prefix}_{name}", documentation, label, read))

    def gauge_by(self, name: str, documentation: str, label: Labels, read: Callable[[], Mapping[Any, float]]) -> None:
        """A gauge with bounded labels (as `counter_by`), read on scrape."""
        self.registry.register(_ReadLabelled(f"{self.prefix}_{name}", documentation, label, read, gauge=True))

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics on a thread; returns the port (port 0 picks one).
        prometheus_client's server, its handler given a read timeout (the
        socket's, set as each connection is taken): without one a client
        that sends half a request held a thread for ever."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        # Read per connection as it is taken: set the moment the thread
        # starts, before the service is SERVING (a connection in between
        # would only lack the timeout).
        quiet: Any = server.RequestHandlerClass
        server.RequestHandlerClass = type("TimedHandler", (quiet,), {"timeout": self.read_timeout_s})
        self._servers.append(server)
        return int(server.server_port)

    def close(self) -> None:
        """Stop serving /metrics (a service's servers end with its process)."""
        for server in self._servers:
            server.shutdown()
            server.server_close()
        self._servers.clear()


class _Read(Collector):
    def __init__(self, prefix: str, read: Callable[[], dict[str, tuple[str, float]]]) -> None:
        self.prefix, self.read = prefix, read

    def collect(self) -> Iterator[CounterMetricFamily]:
        for name, (documentation, value) in self.read().items():
            yield CounterMetricFamily(f"{self.prefix}_{name}", documentation, value=value)


class _ReadLabelled(Collector):
    def __init__(
        self, name: str, documentation: str, label: Labels, read: Callable[[], Mapping[Any, float]], gauge: bool = False
    ) -> None:
        self.name, self.documentation, self.read, self.gauge = name, documentation, read, gauge
        self.several = isinstance(label, tuple)
        self.labels = list(label) if isinstance(label, tuple) else [label]

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        kind = GaugeMetricFamily if self.gauge else CounterMetricFamily
        family = kind(self.name, self.documentation, labels=self.labels)
        for values, count in self.read().items():
            family.add_metric([str(v) for v in values] if self.several else [values], count)
        yield family
