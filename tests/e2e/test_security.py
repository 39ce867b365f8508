"""The scheduler's port faces only our tokenizers: open on loopback, and
anywhere else only to callers with a token or a client certificate (or with
--insecure said in so many words). The tokenizer's client port can serve
TLS. Certificates are made at test time; services bound "elsewhere" run in a
network namespace the test makes, so no traffic leaves it."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mmsplit_cli import samples
from mmsplit_cli.launch import ServiceProcess, scheduler_args, tokenizer_args
from tests.support import netns as netns_support
from tests.support.certs import Pki, make_pki
from tests.support.netns import NetNs, netns
from tests.support.services import ENV, ROOT

pytestmark = pytest.mark.e2e

SCHEDULER_READY = "mmsplit.scheduler.v1.SchedulerService readiness: SERVING"
TOKENIZER_READY = "mmsplit.tokenizer.v1.TokenizerService readiness: SERVING"
NO_NETNS = netns_support.available()


@pytest.fixture
def ns() -> Iterator[NetNs]:
    if NO_NETNS:
        pytest.skip(NO_NETNS)
    with netns() as made:
        yield made


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path / "pki", ["10.213.0.1", "127.0.0.1"])


def inside(ns: NetNs, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*ns.wrapper, sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**ENV, "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
        cwd=ROOT,
    )


def call(ns: NetNs, address: str, *options: str) -> dict[str, str]:
    done = inside(ns, "-m", "tests.support.call_scheduler", address, *options)
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, str] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def start(ns: NetNs, name: str, args: list[str], logs: Path, ready: str) -> ServiceProcess:
    proc = ServiceProcess(name, args, logs / f"{name}.log", env=ENV, wrapper=ns.wrapper)
    proc.wait_logged(ready, 180)
    return proc


def generate(ns: NetNs, address: str, *options: str) -> subprocess.CompletedProcess[str]:
    return inside(ns, "-m", "mmsplit_cli", "generate", "--server", address, "--max-tokens", "3", *options, "Hello")


def test_a_scheduler_off_loopback_without_credentials_refuses_to_start(tiny_model: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mmsplit_cli", *scheduler_args(tiny_model, tp=1, extra=["--host", "0.0.0.0"])],
        capture_output=True,
        text=True,
        timeout=60,
        env={**ENV, "PATH": "/usr/bin:/bin"},
        cwd=ROOT,
    )
    assert done.returncode != 0
    message = done.stderr.strip().splitlines()[-1]
    assert "--host 0.0.0.0 is not a loopback address" in message
    assert "--tls-client-ca" in message
    assert "--auth-token-file" in message
    assert "--insecure" in message


def test_a_token_guards_the_scheduler_off_loopback(ns: NetNs, tiny_model: Path, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret-token-for-this-test\n")
    sched_args = scheduler_args(
        tiny_model, tp=1, extra=["--host", ns.address, "--port", "50551", "--auth-token-file", str(token)]
    )
    sched = start(ns, "scheduler", sched_args, tmp_path, SCHEDULER_READY)
    tok = None
    try:
        address = f"{ns.address}:50551"
        anonymous = call(ns, address)
        assert anonymous["info"] == "UNAUTHENTICATED"
        assert anonymous["reason"] == "UNAUTHENTICATED"
        assert anonymous["generate"] == "UNAUTHENTICATED"
        assert anonymous["health"] == "SERVING"  # probes need no token
        assert call(ns, address, "--token", "wrong")["generate"] == "UNAUTHENTICATED"
        authorised = call(ns, address, "--token", "s3cret-token-for-this-test")
        assert (authorised["info"], authorised["generate"]) == ("OK", "OK")

        tok_args = tokenizer_args(
            tiny_model, address, extra=["--scheduler-auth-token-file", str(token), "--port", "50552"]
        )
        tok = start(ns, "tokenizer", tok_args, tmp_path, TOKENIZER_READY)
        done = generate(ns, "127.0.0.1:50552")
        assert done.returncode == 0, done.stderr[-2000:]
    finally:
        for proc in (tok, sched):
            if proc is not None:
                assert proc.stop() == 0


def test_mutual_tls_guards_the_scheduler_off_loopback(ns: NetNs, pki: Pki, tiny_model: Path, tmp_path: Path) -> None:
    tls = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), "--tls-client-ca", str(pki.ca)]
    sched_args = scheduler_args(tiny_model, tp=1, extra=["--host", ns.address, "--port", "50561", *tls])
    sched = start(ns, "scheduler", sched_args, tmp_path, SCHEDULER_READY)
    tok = None
    try:
        address = f"{ns.address}:50561"
        assert call(ns, address)["info"] == "UNAVAILABLE"  # plaintext: no TLS handshake at all
        no_cert = call(ns, address, "--ca", str(pki.ca))
        assert no_cert["info"] == "UNAVAILABLE"  # refused in the handshake: no client certificate
        assert no_cert["generate"] == "UNAVAILABLE"
        wrong_ca = call(
            ns, address, "--ca", str(pki.other_ca), "--cert", str(pki.client_cert), "--key", str(pki.client_key)
        )
        assert wrong_ca["info"] == "UNAVAILABLE"  # we do not trust its certificate either
        ok = call(ns, address, "--ca", str(pki.ca), "--cert", str(pki.client_cert), "--key", str(pki.client_key))
        assert (ok["info"], ok["generate"]) == ("OK", "OK")

        downstream = [
            "--scheduler-tls-ca", str(pki.ca),
            "--scheduler-tls-cert", str(pki.client_cert),
            "--scheduler-tls-key", str(pki.client_key),
            "--port", "50562",
        ]  # fmt: skip
        tok = start(ns, "tokenizer", tokenizer_args(tiny_model, address, extra=downstream), tmp_path, TOKENIZER_READY)
        done = generate(ns, "127.0.0.1:50562")
        assert done.returncode == 0, done.stderr[-2000:]
    finally:
        for proc in (tok, sched):
            if proc is not None:
                assert proc.stop() == 0


def test_tls_on_the_tokenizers_client_port(pki: Pki, tiny_model: Path, tmp_path: Path) -> None:
    tls = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), "--health-port", "0"]
    sched = ServiceProcess("scheduler", scheduler_args(tiny_model, tp=1), tmp_path / "scheduler.log", env=ENV)
    tok = None
    try:
        sched.wait_serving("mmsplit.scheduler.v1.SchedulerService", 180)
        tok = ServiceProcess(
            "tokenizer", tokenizer_args(tiny_model, sched.address, extra=tls), tmp_path / "tokenizer.log", env=ENV
        )
        tok.wait_logged(TOKENIZER_READY, 180)
        image = tmp_path / "cat.png"
        image.write_bytes(samples.good_png())
        base = [sys.executable, "-m", "mmsplit_cli", "generate", "--server", tok.address, "--max-tokens", "3"]
        secure = subprocess.run(
            [*base, "--tls-ca", str(pki.ca), "--image", str(image), "--json", "What is it?"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**ENV, "PATH": "/usr/bin:/bin"},
            cwd=ROOT,
        )
        assert secure.returncode == 0, secure.stderr[-2000:]
        events = [json.loads(line) for line in secure.stdout.splitlines()]
        assert events[-1]["finished"]["completion_tokens"] == 3
        plain = subprocess.run(
            [*base, "--timeout", "5", "Hi"], capture_output=True, text=True, timeout=60, env={**ENV}, cwd=ROOT
        )
        assert plain.returncode != 0  # a plaintext client gets no answer from a TLS port
    finally:
        for proc in (tok, sched):
            if proc is not None:
                assert proc.stop() == 0
