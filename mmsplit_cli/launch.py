"""Starting the services as child processes and waiting until they serve
(used by the demo and the tests)."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mmsplit_server.serving import PARENT_ENV, free_port

log = logging.getLogger(__name__)

SCHEDULER_SERVICE = "mmsplit.scheduler.v1.SchedulerService"
TOKENIZER_SERVICE = "mmsplit.tokenizer.v1.TokenizerService"
_LISTENING = re.compile(r"listening on (\S+):(\d+)")

# How a service is started: (arguments after `mmsplit`, the full
# environment, whether in a session and process group of its own, the
# wrapper command it runs under, or []) -> a process object with Popen's
# pid, stderr (text), poll, wait, send_signal and kill, or None where the
# launcher cannot start it (that wrapper is not one it knows). None, or no
# launcher: `subprocess.Popen` of a new interpreter under the wrapper. The
# test suite sets a launcher that forks services from a process that has
# already imported torch and transformers (tests/support/zygote.py), so a
# start costs the service's own work only.
Launcher = Callable[[Sequence[str], dict[str, str], bool, Sequence[str]], Any]
_launcher: Launcher | None = None


def set_launcher(launcher: Launcher | None) -> Launcher | None:
    """Use `launcher` to start services; returns the previous one."""
    global _launcher
    previous, _launcher = _launcher, launcher
    return previous


def _tied(env: dict[str, str], wrapper: Sequence[str]) -> dict[str, str]:
    """`env`, asking the service to stop when this process ends however it
    ends (`stop_with_parent`: a launcher killed outright, `mmsplit serve`,
    `make demo` or a benchmark, otherwise left its services running with
    nobody to stop them), where the tie can hold: the service is this
    process's own child (no wrapper command between them, which would be
    its parent) and it is started from the main thread (the kernel signals
    a child when the *thread* that started it ends: one started from a
    thread that ends first would be stopped early; the main thread ends
    with the process)."""
    if wrapper or threading.current_thread() is not threading.main_thread():
        return env
    return {**env, PARENT_ENV: str(os.getpid())}


# What a service logs when a port it was given is taken, in lower case
# (Python's socket: "Address already in use"; asyncio's, as the HTTP API
# reports it: "... address already in use"; gRPC: "Failed to bind").
_PORT_TAKEN = ("address already in use", "failed to bind")


def port_taken(log: str) -> bool:
    """Whether a service's log says a port it was given was taken: a start
    that failed for that alone is tried again on other ports (a port that
    `free_port` found free can be bound by another process before the
    service binds it)."""
    return any(text in log.lower() for text in _PORT_TAKEN)


TAIL_LINES = 200  # a service's last log lines kept in memory (`ServiceProcess.tail`)


class StartFailed(RuntimeError):
    """A service exited, or did not serve in time, while starting."""


class ServiceProcess:
    """One `mmsplit <service>` child. Its log goes to `log_path`; `port` is
    read from the "listening on HOST:PORT" line the server logs."""

    def __init__(
        self,
        name: str,
        args: Sequence[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        wrapper: Sequence[str] = (),
        *,
        echo: str | None = None,
        new_group: bool = False,
    ) -> None:
        """`wrapper` is a command the service runs under (a namespace
        launcher). `echo`: also write each log line to this process's
        standard error, after this name. `new_group`: in a process group of
        its own (a terminal's Ctrl-C then reaches only this process, which
        stops the service itself)."""
        self.name = name
        self._echo = echo
        self.log_path = log_path
        self.port: int | None = None
        self._bound = threading.Event()
        self._terminated = False
        self._recent: deque[str] = deque(maxlen=TAIL_LINES)  # `tail`'s, whether or not the log is kept
        self._recent_lock = threading.Lock()
        self._log = open(log_path, "w")  # noqa: SIM115 (closed by the reader thread)
        full_env = {**os.environ, **(env or {})}
        self.proc: Any = _launcher(list(args), full_env, new_group, list(wrapper)) if _launcher else None
        if self.proc is None:
            self.proc = subprocess.Popen(
                [*wrapper, sys.executable, "-m", "mmsplit_cli", *args],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                text=True,
                env=_tied(full_env, wrapper),
                start_new_session=new_group,
            )
        self._reader = threading.Thread(target=self._read, name=f"{name}-log", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._log.write(line)
            self._log.flush()
            with self._recent_lock:
                self._recent.append(line)
            if self._echo:
                sys.stderr.write(f"[{self._echo}] {line}")
                sys.stderr.flush()
            if self.port is None and (m := _LISTENING.search(line)):
                self.port = int(m.group(2))
                self._bound.set()
        self._log.close()
        self._bound.set()  # exited: wake any waiter

    def wait_bound(self, timeout: float) -> int:
        """The port, once the service logs it; raises as soon as the process
        exits without (its log can stay open for longer: a child that
        inherited it, such as a CPU pool worker, may outlive it)."""
        deadline = time.monotonic() + timeout
        while not self._bound.wait(min(0.2, max(0.0, deadline - time.monotonic()))):
            if self.proc.poll() is not None or time.monotonic() >= deadline:
                break
        if self.port is None:
            raise self._start_failed(f"did not start within {timeout:.0f}s")
        return self.port

    def _start_failed(self, otherwise: str) -> StartFailed:
        """What went wrong: the exit status if the process is gone, else `otherwise`."""
        code = self.proc.poll()
        if code is not None:
            self._reader.join(5)  # its last lines, which say why, read
        why = f"exited with status {code}" if code is not None else otherwise
        return StartFailed(f"{self.name} {why}; see {self.log_path}:\n{self.tail()}")

    def wait_serving(self, service: str, timeout: float) -> None:
        """Wait until health reports `service` SERVING."""
        deadline = time.monotonic() + timeout
        self.wait_bound(timeout)
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        raise self._start_failed(f"is not SERVING after {timeout:.0f}s")

    def wait_logged(self, text: str, timeout: float) -> None:
        """Wait until the service's log shows `text` (for services a plain
        health check cannot reach: TLS-only, or in another network namespace)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.log_path.read_text():
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} never logged {text!r}; see {self.log_path}:\n{self.tail()}")

    def port_taken(self) -> bool:
        """Whether its log says a port it was given was taken (`port_taken`)."""
        return port_taken(self.tail())

    def tail(self, lines: int = 30) -> str:
        """Its last `lines` log lines (at most TAIL_LINES), read so far; kept
        here, so a log sent to /dev/null (`mmsplit serve`'s, echoed) has
        one too."""
        with self._recent_lock:
            return "".join(list(self._recent)[-lines:])

    def terminate(self) -> None:
        """SIGTERM, once, without waiting (`stop` waits). Once is enough:
        a service that is stopping ignores further ones (it drains within
        its grace period all the same)."""
        if self.proc.poll() is None and not self._terminated:
            self._terminated = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (unless already sent), then SIGKILL after `timeout`;
        returns the exit code."""
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) ignored SIGTERM for %.0fs; killing it", self.name, self.pid, timeout)
                self.proc.kill()
                self.proc.wait(10)
        self._reader.join(5)
        return self.proc.returncode


def scheduler_args(model: Path, *, tp: int, extra: Sequence[str] = ()) -> list[str]:
    return ["scheduler", "--model", str(model), "--tp", str(tp), "--port", "0", *extra]


def tokenizer_args(model: Path, scheduler: str, *, extra: Sequence[str] = ()) -> list[str]:
    # No HTTP API unless `extra` asks for one (--http-port N): its default port is fixed.
    return ["tokenizer", "--model", str(model), "--scheduler", scheduler, "--port", "0", "--http-port", "0", *extra]


class FreePort:
    """An argument of `running_pair` that becomes a port free at each start
    attempt (`number`, once started): the pair starts again when a port was
    taken between being chosen and being bound."""

    def __init__(self) -> None:
        self.number = 0

    def draw(self) -> str:
        self.number = free_port()
        return str(self.number)


Arg = str | FreePort
START_ATTEMPTS = 3


@dataclass
class Pair:
    scheduler: ServiceProcess
    tokenizer: ServiceProcess
    model: Path

    @property
    def tokenizer_address(self) -> str:
        return self.tokenizer.address

    @property
    def scheduler_address(self) -> str:
        return self.scheduler.address


def _drawn(args: Sequence[Arg]) -> list[str]:
    return [arg.draw() if isinstance(arg, FreePort) else arg for arg in args]


def started(
    name: str,
    args: Sequence[Arg],
    log_path: Path,
    ready: Callable[[ServiceProcess], object],
    *,
    env: dict[str, str] | None = None,
) -> ServiceProcess:
    """One `ServiceProcess` of `args`, once `ready(it)` returns (its
    `wait_serving`, say); the caller stops it. A `FreePort` among `args` is
    drawn at each attempt, and a start that failed because a port was taken
    before it was bound is made again, up to START_ATTEMPTS times (each
    failed attempt's log kept beside `log_path`)."""
    for attempt in range(1, START_ATTEMPTS + 1):
        proc = ServiceProcess(name, _drawn(args), log_path, env=env)
        try:
            ready(proc)
        except StartFailed:
            proc.stop()
            if not proc.port_taken() or attempt == START_ATTEMPTS:
                raise
            log.warning("a port was taken before it was bound (attempt %d); starting %s again", attempt, name)
            log_path.rename(log_path.with_suffix(f".attempt{attempt}.log"))
            continue
        except BaseException:
            proc.stop()
            raise
        return proc
    raise AssertionError("unreachable: the last attempt returns or raises")


def _stop_all(processes: Sequence[ServiceProcess]) -> None:
    # Both drain at once (the tokenizer is told first): most of a stop is
    # each process's own exit, which need not wait for the other's.
    for proc in processes:
        proc.terminate()
    for proc in processes:
        proc.stop()


@contextmanager
def running_pair(
    model: Path,
    logs: Path,
    *,
    tp: int = 2,
    scheduler_extra: Sequence[Arg] = (),
    tokenizer_extra: Sequence[Arg] = (),
    env: dict[str, str] | None = None,
    wrapper: Sequence[str] = (),
) -> Iterator[Pair]:
    """A scheduler and a tokenizer, both SERVING, each run under `wrapper`
    if given (a command such as `prlimit ... --`). A `FreePort` among the
    arguments is drawn at each attempt; a start that fails because a port
    was taken is tried again, up to START_ATTEMPTS times. On exit both are
    stopped (SIGTERM, then SIGKILL) unless already stopped, including any
    process the caller put in their place on the pair."""
    started: list[ServiceProcess] = []
    pair: Pair | None = None
    try:
        for attempt in range(1, START_ATTEMPTS + 1):
            # Both start at once: the tokenizer waits for the scheduler by itself.
            port = FreePort()
            sched_args = scheduler_args(model, tp=tp, extra=_drawn(["--port", port, *scheduler_extra]))
            started = [ServiceProcess("scheduler", sched_args, logs / "scheduler.log", env=env, wrapper=wrapper)]
            tok_args = tokenizer_args(model, f"127.0.0.1:{port.number}", extra=_drawn(tokenizer_extra))
            started.append(ServiceProcess("tokenizer", tok_args, logs / "tokenizer.log", env=env, wrapper=wrapper))
            sched, tok = started
            try:
                sched.wait_serving(SCHEDULER_SERVICE, 180)
                tok.wait_serving(TOKENIZER_SERVICE, 180)
                break
            except StartFailed:
                if not any(proc.port_taken() for proc in started) or attempt == START_ATTEMPTS:
                    raise
                log.warning("a port was taken before it was bound (attempt %d); starting the pair again", attempt)
                _stop_all(list(reversed(started)))
                for proc in started:  # kept beside the next attempt's
                    proc.log_path.rename(proc.log_path.with_suffix(f".attempt{attempt}.log"))
        pair = Pair(sched, tok, model)
        yield pair
    finally:
        current = [pair.tokenizer, pair.scheduler] if pair is not None else []
        _stop_all([*current, *reversed(started)])
