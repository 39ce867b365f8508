"""The tokenizer's gRPC contract through clients that are not ours and not
Python: Node.js's @grpc/grpc-js (tests/js/contract.js, the protos loaded by
@grpc/proto-loader, error details decoded by protobufjs) and `buf curl`
(Go; grpcurl-style: the schema comes from server reflection, requests and
answers are JSON). Each must see what the Python client sees: the same
tokens for the same greedy request, the same ids from Tokenize, health,
our ErrorInfo in a failure's details; and a deadline or a cancel from
them must free the request on the scheduler."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import google.rpc
import grpc
import pytest
from google.rpc import error_details_pb2

from mmsplit.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mmsplit_cli import samples
from mmsplit_cli.client import make_request, run_request
from tests.e2e.helpers import health_status, rank_active_requests
from tests.support.leaks import wait_until
from tests.support.services import ROOT, TOKENIZER_SERVICE, Pair, running_pair

pytestmark = pytest.mark.e2e

JS = ROOT / "tests" / "js"
NODE = shutil.which("node")
BUF = shutil.which("buf", path=str(Path(sys.executable).parent)) or "buf"
# What contract.js asks for, in the Python client's words.
PROMPT = "Describe this picture: <image>"
IMAGE = samples.good_jpeg(seed=3)
GOOGLEAPIS = Path(next(iter(google.rpc.__path__))).parents[1]  # the directory holding google/rpc/*.proto


@pytest.fixture(scope="module")
def pair(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    with running_pair(tiny_model, tmp_path_factory.mktemp("other-clients"), scheduler_extra=["--tp", "1"]) as pair:
        yield pair


def python_tokens(pair: Pair, request: tokenizer_pb2.GenerateRequest) -> list[int]:
    with grpc.insecure_channel(pair.tokenizer_address) as channel:
        out = run_request(tokenizer_pb2_grpc.TokenizerServiceStub(channel), request)
    assert out.ok, out
    return list(out.token_ids)


def python_tokenize(pair: Pair, request: tokenizer_pb2.GenerateRequest) -> list[int]:
    with grpc.insecure_channel(pair.tokenizer_address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        return list(stub.Tokenize(tokenizer_pb2.TokenizeRequest(request=request), timeout=30).token_ids)


def left_nothing_running(pair: Pair) -> None:
    assert wait_until(lambda: rank_active_requests(pair.scheduler_address) == [0], timeout=30)
    assert health_status(pair.tokenizer_address, TOKENIZER_SERVICE) == "SERVING"
    assert python_tokens(pair, make_request("Still there?", max_tokens=2)), "the next request failed"


@pytest.mark.skipif(NODE is None, reason="Node.js is not installed (make dev installs it where apt can)")
def test_grpc_js_sees_what_the_python_client_sees(pair: Pair, tmp_path: Path) -> None:
    assert (JS / "node_modules" / "@grpc" / "grpc-js").is_dir(), "tests/js is not installed: run `make dev`"
    image = tmp_path / "image.jpg"
    image.write_bytes(IMAGE)
    assert NODE is not None
    done = subprocess.run(
        [NODE, str(JS / "contract.js"), pair.tokenizer_address, str(ROOT / "protos"), str(GOOGLEAPIS), str(image)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    seen: dict[str, list[dict[str, Any]]] = {}
    for line in done.stdout.splitlines():
        report = json.loads(line)
        seen.setdefault(report.pop("check"), []).append(report)

    assert [(h["service"], h["status"]) for h in seen["health"]] == [("", "SERVING"), (TOKENIZER_SERVICE, "SERVING")]
    (info,) = seen["info"]
    assert info["model"] == info["scheduler_model"] != ""
    assert info["transport"].startswith("TRANSPORT_")

    looking = make_request(PROMPT, [IMAGE])
    (tokenized,) = seen["tokenize"]
    assert tokenized["token_ids"] == python_tokenize(pair, looking)

    (generated,) = seen["generate"]
    assert generated["error"] is None
    assert generated["kinds"] == ["delta", "finished"]  # deltas, then one Finished last
    assert len(generated["request_ids"]) == 1
    assert generated["request_ids"][0]
    assert generated["token_ids"] == python_tokens(pair, make_request(PROMPT, [IMAGE], max_tokens=6, min_tokens=6))
    (compressed,) = seen["generate gzip"]  # its request gzip-compressed: the server inflates it
    assert (compressed["token_ids"], compressed["error"]) == (generated["token_ids"], None)
    finished = generated["finished"]
    assert finished["finish_reason"] == "FINISH_REASON_LENGTH"
    assert (finished["prompt_tokens"], finished["completion_tokens"]) == (len(tokenized["token_ids"]), 6)

    (corrupt,) = seen["corrupt image"]
    error = corrupt["error"]
    assert error["code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0] == error["status_code"]
    assert (error["reason"], error["domain"]) == ("MEDIA_DECODE_FAILED", "mmsplit")
    assert error["metadata"]["retriable"] == "false"
    assert error["metadata"]["request_id"]
    assert corrupt["kinds"] == []

    (late,) = seen["deadline"]
    assert late["error"]["code"] == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert late["finished"] is None
    (cancelled,) = seen["cancel"]
    assert cancelled["error"]["code"] == grpc.StatusCode.CANCELLED.value[0]
    assert cancelled["kinds"] == ["delta"]
    assert cancelled["finished"] is None
    left_nothing_running(pair)


def buf_curl(pair: Pair, *args: str, data: dict[str, Any] | None = None) -> subprocess.CompletedProcess[str]:
    command = [BUF, "curl", "--protocol", "grpc", "--http2-prior-knowledge", *args]
    if data is not None:
        command += ["--data", "@-"]  # from standard input: an image is past an argument's size limit
    body = json.dumps(data) if data is not None else None
    return subprocess.run(command, input=body, capture_output=True, text=True, timeout=60)


def method(pair: Pair, name: str) -> str:
    return f"http://{pair.tokenizer_address}/{name}"


def json_values(text: str) -> list[dict[str, Any]]:
    """The JSON documents `text` holds one after another (buf curl's output of a stream)."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while text[at:].strip():
        value, end = decoder.raw_decode(text, at + len(text[at:]) - len(text[at:].lstrip()))
        values.append(value)
        at = end
    return values


def test_buf_curl_finds_everything_by_reflection_v1_and_v1alpha(pair: Pair) -> None:
    """Reflection under both names (v1 is what grpcurl and buf curl ask
    first; grpcio-reflection serves only v1alpha): the same services, every
    one of which resolves."""
    listed = {}
    for protocol in ("grpc-v1", "grpc-v1alpha"):
        done = buf_curl(pair, "--reflect-protocol", protocol, "--list-methods", f"http://{pair.tokenizer_address}")
        assert done.returncode == 0, done.stderr
        listed[protocol] = set(done.stdout.split())
    assert listed["grpc-v1"] == listed["grpc-v1alpha"]
    assert {
        f"{TOKENIZER_SERVICE}/Generate",
        f"{TOKENIZER_SERVICE}/Tokenize",
        f"{TOKENIZER_SERVICE}/GetServerInfo",
        "grpc.health.v1.Health/Check",
        "grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        "grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    } <= listed["grpc-v1"]


def test_buf_curl_generates_the_python_client_s_tokens_and_reads_our_error(pair: Pair) -> None:
    health = buf_curl(pair, method(pair, "grpc.health.v1.Health/Check"), data={"service": TOKENIZER_SERVICE})
    assert health.returncode == 0, health.stderr
    assert json.loads(health.stdout) == {"status": "SERVING"}

    image = base64.b64encode(IMAGE).decode()
    request = {"prompt": PROMPT, "images": [{"data": image}], "sampling": {"maxTokens": 6, "minTokens": 6}}
    done = buf_curl(pair, method(pair, f"{TOKENIZER_SERVICE}/Generate"), data=request)
    assert done.returncode == 0, done.stderr
    events = json_values(done.stdout)
    # Deltas, then one Finished. A delta may carry several tokens (a stream
    # that fell behind is joined: docs/grpc-api.md), so tokens are counted.
    assert [next(k for k in ("delta", "finished") if k in e) for e in events] == ["delta"] * (len(events) - 1) + [
        "finished"
    ]
    assert len(events) >= 2
    tokens = [int(t) for e in events[:-1] for t in e["delta"]["tokenIds"]]
    assert tokens == python_tokens(pair, make_request(PROMPT, [IMAGE], max_tokens=6, min_tokens=6))
    assert events[-1]["finished"]["completionTokens"] == 6

    corrupt = {"prompt": "Describe <image>", "images": [{"data": base64.b64encode(IMAGE[:300]).decode()}]}
    failed = buf_curl(pair, method(pair, f"{TOKENIZER_SERVICE}/Generate"), data=corrupt)
    assert failed.returncode != 0
    (error,) = json_values(failed.stderr)
    assert error["code"] == "invalid_argument"
    (detail,) = error["details"]
    assert detail["type"] == "google.rpc.ErrorInfo"
    info = error_details_pb2.ErrorInfo.FromString(base64.b64decode(detail["value"] + "=" * (-len(detail["value"]) % 4)))
    assert (info.reason, info.domain, info.metadata["retriable"]) == ("MEDIA_DECODE_FAILED", "mmsplit", "false")
    left_nothing_running(pair)
