"""The scheduler's port faces only our tokenizers: open on loopback, and
anywhere else only to callers with a token or a client certificate (or with
--insecure said in so many words). The tokenizer's client port can serve
TLS. Certificates are made at test time; services bound "elsewhere" run in a
network namespace the test makes, so no traffic leaves it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
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


@dataclass
class Secured:
    """One group off loopback in a namespace: a scheduler requiring both a
    client certificate and the token, a tokenizer presenting both and
    serving TLS on its own port."""

    ns: NetNs
    pki: Pki
    token: str
    scheduler: str
    tokenizer: str
    token_file: Path  # both services': the scheduler takes its tokens, the tokenizer sends its first


@pytest.fixture(scope="module")
def secured(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    if NO_NETNS:
        pytest.skip(NO_NETNS)
    tmp = tmp_path_factory.mktemp("secured")
    pki = make_pki(tmp / "pki", ["10.213.0.1", "127.0.0.1"])
    token = tmp / "token"
    token.write_text("s3cret-token-for-this-test\n")
    with netns() as ns:
        sched_tls = [
            "--tls-cert",
            str(pki.server_cert),
            "--tls-key",
            str(pki.server_key),
            "--tls-client-ca",
            str(pki.ca),
        ]
        sched_args = scheduler_args(
            tiny_model,
            tp=1,
            extra=["--host", ns.address, "--port", "50551", "--auth-token-file", str(token), *sched_tls],
        )
        sched = start(ns, "scheduler", sched_args, tmp, SCHEDULER_READY)
        tok = None
        try:
            downstream = [
                "--scheduler-tls-ca", str(pki.ca),
                "--scheduler-tls-cert", str(pki.client_cert),
                "--scheduler-tls-key", str(pki.client_key),
                "--scheduler-auth-token-file", str(token),
                "--tls-cert", str(pki.server_cert),
                "--tls-key", str(pki.server_key),
                "--port", "50552",
            ]  # fmt: skip
            tok_args = tokenizer_args(tiny_model, f"{ns.address}:50551", extra=downstream)
            tok = start(ns, "tokenizer", tok_args, tmp, TOKENIZER_READY)
            yield Secured(ns, pki, "s3cret-token-for-this-test", f"{ns.address}:50551", "127.0.0.1:50552", token)
        finally:
            for proc in (tok, sched):
                if proc is not None:
                    assert proc.stop() == 0


def test_without_a_client_certificate_the_handshake_refuses(secured: Secured) -> None:
    pki = secured.pki
    plain = call(secured.ns, secured.scheduler, "--token", secured.token)
    assert plain["info"] == "UNAVAILABLE"  # plaintext against TLS: no handshake at all
    no_cert = call(secured.ns, secured.scheduler, "--ca", str(pki.ca), "--token", secured.token)
    assert (no_cert["info"], no_cert["generate"]) == ("UNAVAILABLE", "UNAVAILABLE")
    client = ["--cert", str(pki.client_cert), "--key", str(pki.client_key), "--token", secured.token]
    wrong_ca = call(secured.ns, secured.scheduler, "--ca", str(pki.other_ca), *client)
    assert wrong_ca["info"] == "UNAVAILABLE"  # and we do not trust the server's certificate either


def test_without_the_token_a_caller_is_unauthenticated_except_for_health(secured: Secured) -> None:
    pki = secured.pki
    tls = ["--ca", str(pki.ca), "--cert", str(pki.client_cert), "--key", str(pki.client_key)]
    anonymous = call(secured.ns, secured.scheduler, *tls)
    assert anonymous["info"] == "UNAUTHENTICATED"
    assert anonymous["reason"] == "UNAUTHENTICATED"
    assert anonymous["generate"] == "UNAUTHENTICATED"
    assert anonymous["health"] == "SERVING"  # probes need no token
    assert call(secured.ns, secured.scheduler, *tls, "--token", "wrong")["generate"] == "UNAUTHENTICATED"
    authorised = call(secured.ns, secured.scheduler, *tls, "--token", secured.token)
    assert (authorised["info"], authorised["generate"]) == ("OK", "OK")


def test_the_tokenizer_presents_its_credentials_and_serves_tls_to_clients(secured: Secured, tmp_path: Path) -> None:
    image = tmp_path / "cat.png"
    image.write_bytes(samples.good_png())
    done = generate(secured.ns, secured.tokenizer, "--tls-ca", str(secured.pki.ca), "--image", str(image), "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    events = [json.loads(line) for line in done.stdout.splitlines()]
    assert events[-1]["finished"]["completion_tokens"] == 3
    plain = generate(secured.ns, secured.tokenizer, "--timeout", "5")
    assert plain.returncode != 0  # a plaintext client gets no answer from a TLS port


def test_the_token_rotates_without_a_restart(secured: Secured, tmp_path: Path) -> None:
    """Both services read their token files again when they change: with
    a new token only, the tokenizer presents it and the scheduler takes it
    (a generation through both), and the old one is refused."""
    pki = secured.pki
    tls = ["--ca", str(pki.ca), "--cert", str(pki.client_cert), "--key", str(pki.client_key)]
    rotated = secured.token_file.with_suffix(".new")
    try:
        rotated.write_text("# rotated\nthe-rotated-token\n")
        os.replace(rotated, secured.token_file)
        done = generate(secured.ns, secured.tokenizer, "--tls-ca", str(pki.ca), "--json")
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads(done.stdout.splitlines()[-1])["finished"]["completion_tokens"] == 3
        assert call(secured.ns, secured.scheduler, *tls, "--token", secured.token)["generate"] == "UNAUTHENTICATED"
    finally:
        secured.token_file.write_text(secured.token + "\n")
