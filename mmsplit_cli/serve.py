"""`mmsplit serve`: a scheduler group and a tokenizer on this machine, one
command.

    mmsplit serve --model DIR [--tp N] [--host H] [--port 50052] [--http-port 8000]

The scheduler listens on a free loopback port (drawn again, and both
started again, should another process bind it first: the scheduler binds it
only once its model is loaded) and requires a random token
that only its tokenizer is given (a file in a directory only this user can
enter, removed at the end, or by the next serve if this one is killed outright): other users of the host cannot send it
requests. The tokenizer serves gRPC and the OpenAI-compatible HTTP API on
the fixed default ports. Both logs go to standard error, each line after
its service's name; a ready line says where to send requests. SIGINT or
SIGTERM stops both (the tokenizer first, then the scheduler, each draining
its requests); a second one ends them at once. A model directory that is
not there, or a port that is taken, stops the command before anything
starts, with one line saying so.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType

from mmsplit_cli import private_dirs
from mmsplit_cli.launch import SCHEDULER_SERVICE, START_ATTEMPTS, TOKENIZER_SERVICE, ServiceProcess, port_taken
from mmsplit_cli.startup import first_problem
from mmsplit_server.serving import free_port

START_TIMEOUT_S = 600.0  # a real checkpoint can take minutes to load


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, type=Path, help="local checkpoint directory")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the scheduler group (default 1)")
    p.add_argument("--host", default="127.0.0.1", help="address the tokenizer serves gRPC and HTTP on")
    p.add_argument("--port", type=int, default=50052, help="the tokenizer's gRPC port (default 50052)")
    p.add_argument("--http-port", type=int, default=8000, help="the OpenAI-compatible HTTP API's port; 0 = off")
    for service, example in (("scheduler", "--scheduler-arg=--device=cuda"), ("tokenizer", "")):
        p.add_argument(
            f"--{service}-arg",
            action="append",
            default=[],
            metavar="ARG",
            help=f"one more argument for `mmsplit {service}` (repeatable)" + (f", e.g. {example}" if example else ""),
        )


def serve_command(args: argparse.Namespace) -> int:
    problem = _precheck(args)
    if problem:
        print(f"mmsplit serve: {problem}", file=sys.stderr)
        return 2
    private = private_dirs.make("mmsplit-serve-")  # mode 0700; a killed serve's is removed by the next
    stopping = threading.Event()
    started: list[ServiceProcess] = []
    stops = 0

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stops
        stops += 1
        if stops == 1:
            print("mmsplit serve: stopping (the tokenizer, then the scheduler); again to stop at once", file=sys.stderr)
            stopping.set()
        else:
            print("mmsplit serve: stopping at once", file=sys.stderr)
            for proc in started:
                proc.proc.kill()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        token = private / "scheduler-token"
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
        for attempt in range(1, START_ATTEMPTS + 1):
            scheduler_port = free_port()
            started[:] = _start(args, token, scheduler_port)
            if _wait_serving(started, stopping):
                break
            if stopping.is_set():
                return _stop(started)
            failed = next((p for p in started if p.proc.poll() is not None), None)
            _stop(started)
            if attempt < START_ATTEMPTS and _lost_port(started[0], scheduler_port):
                print(
                    f"mmsplit serve: another process bound the scheduler's port {scheduler_port} first; "
                    "starting both again on another",
                    file=sys.stderr,
                )
                continue
            who = failed.name if failed else "a service"
            print(f"mmsplit serve: the {who} could not start (its log is above); stopping", file=sys.stderr)
            return 1
        where = f"{args.host}:{started[1].port}"  # --port 0: the port it was given
        http = f", OpenAI API http://{args.host}:{args.http_port}/v1" if args.http_port else ""
        print(f"mmsplit serve: ready: gRPC {where}{http} (model {args.model.name}, tp {args.tp})", file=sys.stderr)
        while not stopping.wait(0.5):
            gone = next((p for p in started if p.proc.poll() is not None), None)
            if gone is not None:
                print(f"mmsplit serve: the {gone.name} exited ({gone.proc.returncode}); stopping", file=sys.stderr)
                _stop(started)
                return 1
        return _stop(started)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(private, ignore_errors=True)


def _start(args: argparse.Namespace, token: Path, scheduler_port: int) -> list[ServiceProcess]:
    """The scheduler and the tokenizer, at once: the tokenizer waits for
    the scheduler by itself."""
    scheduler = [
        "scheduler", "--model", str(args.model), "--tp", str(args.tp), "--host", "127.0.0.1",
        "--port", str(scheduler_port), "--auth-token-file", str(token), *args.scheduler_arg,
    ]  # fmt: skip
    tokenizer = [
        "tokenizer", "--model", str(args.model), "--scheduler", f"127.0.0.1:{scheduler_port}",
        "--scheduler-auth-token-file", str(token), "--host", args.host, "--port", str(args.port),
        "--http-port", str(args.http_port), *args.tokenizer_arg,
    ]  # fmt: skip
    # Separate process groups: a terminal's Ctrl-C reaches this process
    # only, which stops the services in order. Should this process end
    # without stopping them (killed outright), each gets SIGTERM from the
    # kernel (`ServiceProcess` asks for it: started here, from the main
    # thread).
    return [
        ServiceProcess(name, service_args, Path(os.devnull), echo=name, new_group=True)
        for name, service_args in (("scheduler", scheduler), ("tokenizer", tokenizer))
    ]


def _lost_port(scheduler: ServiceProcess, port: int) -> bool:
    """Whether the scheduler could not start because another process bound
    its port (drawn free) first."""
    said = scheduler.tail()
    return port_taken(said) and f"127.0.0.1:{port}" in said


def _precheck(args: argparse.Namespace) -> str:
    if args.tp < 1:
        return "--tp must be at least 1"
    if args.port and args.port == args.http_port:
        return f"--port and --http-port are both {args.port}: give each its own port"
    ports = [(args.host, args.port, "--port"), (args.host, args.http_port, "--http-port")]
    return first_problem(args.model, ports, (args.tp, "--tp"), weights=True)


def _wait_serving(started: list[ServiceProcess], stopping: threading.Event) -> bool:
    """Both SERVING (True), or one exited or a stop was asked (False)."""
    services = {"scheduler": SCHEDULER_SERVICE, "tokenizer": TOKENIZER_SERVICE}
    deadline = time.monotonic() + START_TIMEOUT_S
    for proc in started:
        while True:
            if stopping.is_set() or any(p.proc.poll() is not None for p in started) or time.monotonic() > deadline:
                return False
            try:
                proc.wait_serving(services[proc.name], timeout=2.0)
                break
            except RuntimeError:
                continue
    return True


def _stop(started: list[ServiceProcess]) -> int:
    """The tokenizer first (it drains, then leaves), then the scheduler."""
    codes = []
    for proc in reversed(started):
        proc.terminate()
        codes.append(proc.stop(timeout=60))
    return 0 if all(code == 0 for code in codes) else 1
