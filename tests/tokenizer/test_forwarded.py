"""Who a request behind a proxy came from (`--forwarded-allow-ips`): the
address X-Forwarded-For names when, and only when, the peer is a proxy
the tokenizer trusts, and never an entry the client could have written."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from mmsplit_server.settings import InvalidSettings
from tokenizer_svc.http_api import forwarded_client
from tokenizer_svc.settings import TokenizerSettings

PROXIES = (ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("::1/128"))


def test_only_a_trusted_peer_s_x_forwarded_for_is_read() -> None:
    assert forwarded_client("203.0.113.9", ["198.51.100.1"], PROXIES) == "203.0.113.9"  # not a proxy: its own
    assert forwarded_client("10.1.2.3", ["198.51.100.1"], PROXIES) == "198.51.100.1"
    assert forwarded_client("10.1.2.3", ["198.51.100.1"], ()) == "10.1.2.3"  # nothing trusted
    assert forwarded_client("::1", ["2001:db8::7"], PROXIES) == "2001:db8::7"
    assert forwarded_client("10.1.2.3", [], PROXIES) == "10.1.2.3"  # a proxy's own request


def test_the_right_most_untrusted_hop_is_the_client_whatever_it_wrote_before() -> None:
    # The client wrote "1.1.1.1"; the trusted proxies appended the rest, the first of them the client's address.
    assert forwarded_client("10.0.0.2", ["1.1.1.1, 198.51.100.1, 10.0.0.1"], PROXIES) == "198.51.100.1"
    assert forwarded_client("10.0.0.2", ["1.1.1.1", "198.51.100.1, 10.0.0.1"], PROXIES) == "198.51.100.1"
    assert forwarded_client("10.0.0.2", ["10.0.0.5, 10.0.0.1"], PROXIES) == "10.0.0.5"  # every hop a proxy
    assert forwarded_client("10.0.0.2", ["unknown"], PROXIES) == "unknown"  # not an address: untrusted, kept as named


def test_a_bad_network_is_a_start_up_problem(tmp_path: Path) -> None:
    good = TokenizerSettings(model_dir=tmp_path, forwarded_allow_ips="10.0.0.0/8, 127.0.0.1")
    assert [str(n) for n in good.trusted_proxies] == ["10.0.0.0/8", "127.0.0.1/32"]
    with pytest.raises(InvalidSettings, match=r"--forwarded-allow-ips: 'proxy\.local' does not appear"):
        TokenizerSettings(model_dir=tmp_path, forwarded_allow_ips="10.0.0.0/8,proxy.local")
