"""How the services declare their settings: one dataclass field per setting,
its help, and the range or choices it must lie in, checked when the settings
object is made (so a bad value stops the service at startup with a clear
message, never later as a wedged or spinning server). `ServiceSettings` holds
what both services share; each service's settings class extends it."""

from __future__ import annotations

import dataclasses
import resource
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

from mmsplit.keepalive import MIN_PING_INTERVAL_MS
from mmsplit_server.handoff.files import check_prefix
from mmsplit_server.serving import LOG_FORMATS

T = TypeVar("T")


class InvalidSettings(ValueError):
    """One or more settings are outside what they accept; the message lists each."""


def opt(default: T, help: str, *, min: float | None = None, choices: Iterable[str] | None = None) -> T:
    """A setting with a default. `min` is the smallest value accepted (for
    numbers); `choices` the values accepted (for strings)."""
    metadata: dict[str, Any] = {"help": help}
    if min is not None:
        metadata["min"] = min
    if choices is not None:
        metadata["choices"] = tuple(choices)
    result: T = dataclasses.field(default=default, metadata=metadata)
    return result


def flag_of(f: dataclasses.Field[Any]) -> str:
    flag: str = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
    return flag


def check(settings: Any, *extra: str) -> None:
    """Raise InvalidSettings listing every field outside its range or
    choices, and the `extra` problems the caller found across fields."""
    problems = []
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if "min" in f.metadata and value < f.metadata["min"]:
            problems.append(f"{flag_of(f)} must be at least {f.metadata['min']:g} (got {value})")
        if "choices" in f.metadata and value not in f.metadata["choices"]:
            problems.append(f"{flag_of(f)} must be one of {', '.join(f.metadata['choices'])} (got {value!r})")
    problems.extend(extra)
    if problems:
        raise InvalidSettings("; ".join(problems))


def keepalive_problems(keepalive_s: float) -> list[str]:
    """`--keepalive-s` pings no more often than our servers accept (`mmsplit.keepalive`)."""
    least = MIN_PING_INTERVAL_MS / 1000
    if 0 < keepalive_s < least:
        return [f"--keepalive-s must be 0 (off) or at least {least:g}, not {keepalive_s:g}"]
    return []


def port_clashes(ports: list[tuple[str, str, int]]) -> list[str]:
    """Two of a service's servers given one port of one address (the second
    bind would fail once the first server runs, after the model loaded)."""
    problems = []
    first: dict[tuple[str, int], str] = {}
    for flag, host, port in ports:
        if not port:
            continue
        if (host, port) in first:
            problems.append(f"{first[host, port]} and {flag} are both {port} on {host}: give each its own port")
        else:
            first[host, port] = flag
    return problems


def prefix_problems(prefix: str) -> list[str]:
    """`--shm-prefix` must be a prefix `mmsplit_server.handoff.files` accepts."""
    try:
        check_prefix(prefix)
    except ValueError as exc:
        return [f"--shm-prefix: {exc}"]
    return []


# The automatic --max-connections: at most this many per serving port.
CONNECTIONS_AT_MOST = 10_000
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "debug", "info", "warning", "error")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServiceSettings:
    """What both services share: the model, the gRPC server and its TLS, the
    side servers (health, metrics), logs, shared memory, keepalive, stopping,
    and the request limits both enforce. A service's own settings class
    extends this one; a field it redefines (a different default or help)
    keeps its place in `--help`. `problems()` lists what the values get wrong
    together; a subclass adds its own to the base's."""

    model_dir: Path = dataclasses.field(metadata={"help": "local checkpoint directory", "flag": "--model"})
    host: str = opt("127.0.0.1", "address to serve gRPC on")
    port: int = opt(0, "port to serve gRPC on; 0 picks a free one (logged)", min=0)
    tls_cert: str = opt("", "PEM certificate (chain) of this server: serve TLS (with --tls-key)")
    tls_key: str = opt("", "PEM private key of --tls-cert")
    tls_client_ca: str = opt("", "PEM CA certificates: require clients to present a certificate they signed (mTLS)")
    health_port: int = opt(0, "also serve grpc.health.v1 alone, plaintext, on this port (probes); 0 = off", min=0)
    health_host: str = opt("", "address of the --health-port server; empty = --host")
    metrics_port: int = opt(0, "serve Prometheus /metrics (plain HTTP) on this port; 0 = off", min=0)
    metrics_host: str = opt("", "address of the --metrics-port server; empty = --host")
    log_level: str = opt("INFO", "logging level", choices=LOG_LEVELS)
    log_format: str = opt(
        "text", "text, or json: one JSON object per line, finished requests with their fields", choices=LOG_FORMATS
    )
    shm_prefix: str = opt("mmsplit", "prefix of the shared-memory segments this service creates or accepts")
    janitor_interval_s: float = opt(30.0, "how often orphaned segments of the prefix are swept", min=0.01)
    segment_grace_s: float = opt(
        30.0,
        "a segment of the prefix nobody holds a lock on, older than this, is an orphan the janitor removes",
        min=0.01,
    )
    cuda_ipc_backend: str = opt(
        "mmsplit_server.handoff.cuda_ipc:cuda_backend",
        "module:factory of the device backend that makes or opens CUDA IPC handles (tests substitute a fake device)",
    )
    max_images_per_request: int = opt(8, "images one request may carry", min=0)
    max_tokens_limit: int = opt(4096, "largest max_tokens accepted", min=1)
    max_message_bytes: int = opt(256 * 1024 * 1024, "largest gRPC message, bytes", min=0)
    runtime_dir: str = opt(
        "",
        "a directory only this user may enter (mode 700), for the scheduler's local token (mmsplit.localauth); "
        "empty = $XDG_RUNTIME_DIR/mmsplit, else /tmp/mmsplit-<uid>",
    )
    shutdown_grace_s: float = opt(5.0, "seconds running requests get to finish on SIGTERM or Ctrl-C", min=0)
    keepalive_s: float = opt(
        20.0,
        "seconds between HTTP/2 keepalive pings on every connection this service holds: a peer that stops "
        "answering (its node gone, a network partition) is found within this plus --keepalive-timeout-s, and its "
        "calls end (their requests aborted, their memory released); at least 1; 0 = off",
        min=0,
    )
    keepalive_timeout_s: float = opt(
        10.0, "how long a keepalive ping may go unanswered before its connection is closed", min=0.1
    )
    max_connections: int = opt(
        0,
        "client connections each port serving requests (gRPC, and the tokenizer's HTTP) keeps open at once; a new "
        "one past it is closed at once, unread (clients retry), so a flood of connections cannot take the "
        "descriptors that requests need; 0 = a quarter of the open-file limit, at most 10,000",
        min=0,
    )

    @property
    def connection_limit(self) -> int:
        """Client connections each serving port keeps open at once
        (`max_connections`, or a quarter of this process's open-file limit
        as it is now: read after the service raised it, at most 10,000)."""
        if self.max_connections:
            return self.max_connections
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return CONNECTIONS_AT_MOST if soft == resource.RLIM_INFINITY else max(16, min(CONNECTIONS_AT_MOST, soft // 4))

    def __post_init__(self) -> None:
        check(self, *self.problems())

    def problems(self) -> list[str]:
        """What the values get wrong together (ranges and choices are checked field by field)."""
        problems = prefix_problems(self.shm_prefix)
        problems.extend(keepalive_problems(self.keepalive_s))
        if bool(self.tls_cert) != bool(self.tls_key):
            problems.append("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            problems.append("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)")
        problems.extend(port_clashes(self.served_ports()))
        return problems

    def served_ports(self) -> list[tuple[str, str, int]]:
        """(flag, host, port) of every port this service binds (0: a free one, or off)."""
        return [
            ("--port", self.host, self.port),
            ("--health-port", self.health_host or self.host, self.health_port),
            ("--metrics-port", self.metrics_host or self.host, self.metrics_port),
        ]
