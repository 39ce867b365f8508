"""`mmsplit serve` as a user runs it: one command, a ready line, a request
with the OpenAI SDK and one over gRPC, Ctrl-C (SIGINT), exit 0, nothing
left; a port in use or a missing model is one clear line and a non-zero
exit before anything starts."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import openai
import psutil
import pytest

from mmsplit.client import Client
from mmsplit_cli import launch, private_dirs
from mmsplit_server.serving import PARENT_ENV, free_port
from tests.support.serve_output import ServeOutput, serving
from tests.support.services import ENV, ROOT

pytestmark = pytest.mark.e2e


def _serve(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "mmsplit_cli", "serve", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, **ENV},
    )


def test_one_command_serves_both_apis_and_ctrl_c_stops_it_cleanly(chat_models: Callable[[str], Path]) -> None:
    http_port = free_port()  # (0 turns the HTTP API off; gRPC's port 0 is drawn, and the ready line names it)
    model = chat_models("llava")
    with serving(_serve(["--model", str(model), "--port", "0", "--http-port", str(http_port)])) as out:
        said = next(line for line in out.lines if "ready:" in line)
        assert out.grpc_address.startswith("127.0.0.1:"), said
        assert f"http://127.0.0.1:{http_port}/v1" in said
        sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none")
        reply = sdk.chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": "Hello"}], max_tokens=3
        )
        assert reply.choices[0].finish_reason in ("stop", "length")
        with Client(out.grpc_address) as client:
            assert client.complete(messages=[("user", "Hello")], max_tokens=3).text == reply.choices[0].message.content
    assert "stopping (the tokenizer, then the scheduler)" in out.text


def test_a_serve_killed_outright_takes_its_services_with_it(chat_models: Callable[[str], Path]) -> None:
    """SIGKILL (the OOM killer, say) leaves `mmsplit serve` no time to stop
    its services: the kernel sends each SIGTERM as its parent dies
    (`mmsplit_server.serving.stop_with_parent`, asked for by every
    `ServiceProcess` started from a main thread: `make demo`'s and the
    benchmarks' too), and they stop as on any SIGTERM, instead of holding
    their ports and memory with nobody to stop them."""
    proc = _serve(["--model", str(chat_models("llava")), "--port", "0", "--http-port", "0"])
    out = ServeOutput(proc)
    services: list[psutil.Process] = []
    try:
        assert out.wait_ready(180), out.tail()
        services = psutil.Process(proc.pid).children()
        assert sorted(s.cmdline()[3:4] for s in services) == [
            ["scheduler"],
            ["tokenizer"],
        ]  # python -m mmsplit_cli NAME
        proc.kill()
        proc.wait()
        _, alive = psutil.wait_procs(services, timeout=60)
        assert not alive, f"outlived their serve: {[s.cmdline()[3:4] for s in alive]}"
    finally:
        for service in services:
            with contextlib.suppress(psutil.NoSuchProcess):
                service.kill()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.join()
    # What a serve killed outright cannot remove: its directory of the
    # scheduler's token, which the services read again while they run (a
    # rotated token), so it cannot go before they stop. The next serve
    # removes it as it starts (`private_dirs.make`), this sweep being its first step.
    left = list(Path(ENV["TMPDIR"]).glob("mmsplit-serve-*"))
    assert len(left) == 1, left
    assert private_dirs.sweep("mmsplit-serve-", Path(ENV["TMPDIR"])) == left


def test_a_service_is_tied_to_its_launcher_only_where_the_tie_holds() -> None:
    """The kernel signals a child when the thread that started it ends, and
    a wrapper command in between would be the service's parent: a service
    started from another thread, or under a wrapper, is not tied (it would
    be stopped early, or at once)."""
    env = {"MMSPLIT_LOG_LEVEL": "INFO"}
    assert launch._tied(env, []) == {**env, PARENT_ENV: str(os.getpid())}
    assert launch._tied(env, ["unshare", "--net", "--"]) == env
    from_thread: list[dict[str, str]] = []
    thread = threading.Thread(target=lambda: from_thread.append(launch._tied(env, [])))
    thread.start()
    thread.join()
    assert from_thread == [env]


def test_a_scheduler_port_taken_before_the_scheduler_binds_it_is_drawn_again(
    chat_models: Callable[[str], Path],
) -> None:
    """The scheduler's loopback port is drawn free and bound only once the
    model has loaded (minutes, for a real checkpoint): another process may
    bind it first. Serve then starts both services again on another port
    instead of failing. The draw is made to hit a port this test holds
    (the scheduler finds it taken at its start-up check, as it would at its
    bind, by the same words); with `--port 0` the ready line names the port
    the tokenizer got."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        held = taken.getsockname()[1]
        draws = (
            "import itertools, sys\n"
            "from mmsplit_cli import serve\n"
            "from mmsplit_cli.main import main\n"
            f"draws = itertools.chain([{held}], iter(serve.free_port, None))\n"
            "serve.free_port = lambda: next(draws)\n"
            "main(sys.argv[1:])\n"
        )
        model = chat_models("llava")
        proc = subprocess.Popen(
            [sys.executable, "-c", draws, "serve", "--model", str(model), "--port", "0", "--http-port", "0"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            cwd=ROOT, env={**os.environ, **ENV},
        )  # fmt: skip
        with serving(proc) as out:
            text = out.text
            assert f"mmsplit serve: another process bound the scheduler's port {held} first" in text
            assert f"scheduler listening on 127.0.0.1:{held}" not in text
            ready = next(line for line in out.lines if "ready:" in line)
            port = int(ready.split("gRPC 127.0.0.1:")[1].split()[0])
            assert port not in (0, held)
            with Client(f"127.0.0.1:{port}") as client:
                assert client.complete(messages=[("user", "Hello")], max_tokens=3).text


def test_a_port_in_use_or_a_missing_model_is_one_line_before_anything_starts(
    chat_models: Callable[[str], Path], tmp_path: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _serve(["--model", str(chat_models("llava")), "--http-port", str(port), "--port", "0"])
        _, err = done.communicate(timeout=60)
    assert done.returncode == 2
    assert err.strip().splitlines() == [
        f"mmsplit serve: --http-port {port}: 127.0.0.1:{port} cannot be bound (Address already in use): "
        "stop what holds it, or pick another"
    ]
    missing = _serve(["--model", str(tmp_path / "nope")])
    _, err = missing.communicate(timeout=60)
    assert missing.returncode == 2
    assert err.strip().splitlines() == [
        f"mmsplit serve: --model {tmp_path / 'nope'}: no such directory (give a local checkpoint directory)"
    ]
