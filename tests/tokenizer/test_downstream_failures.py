"""How the tokenizer reads a failed call to its scheduler (`SchedulerLink._failure`):
our scheduler's own errors keep their ErrorInfo's code; what gRPC itself
reports when the connection breaks mid-call is the scheduler being
unavailable (retriable), INTERNAL "Internal error from Core" included: a
killed group once surfaced as a non-retriable INTERNAL (the chaos test).
And which backend a failing request may go to instead (`Schedulers.pick`),
and what the tokenizer says of a server at --scheduler that is none."""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from mmsplit.errors import E, MmsplitError
from mmsplit_server.serving import ClientSecurity
from tokenizer_svc.downstream import SchedulerLink, Schedulers
from tokenizer_svc.errors import InternalError, MediaDecodeFailed
from tokenizer_svc.settings import TokenizerSettings


def _failed(code: grpc.StatusCode, details: str, typed: MmsplitError | None = None) -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata()
    if isinstance(typed, MmsplitError):
        trailing = grpc.aio.Metadata(*typed.to_status().trailing_metadata)
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details)


def test_grpc_s_own_internal_is_the_scheduler_unavailable_and_ours_stays_typed(tmp_path: Path) -> None:
    async def run() -> list[int]:
        link = SchedulerLink(TokenizerSettings(model_dir=tmp_path), ClientSecurity(), "127.0.0.1:1")
        try:
            return [
                link._failure(exc).error_code
                for exc in (
                    _failed(grpc.StatusCode.INTERNAL, "Internal error from Core"),
                    _failed(grpc.StatusCode.UNAVAILABLE, "Socket closed"),
                    _failed(grpc.StatusCode.INTERNAL, "a bug", InternalError("a bug")),
                    _failed(grpc.StatusCode.INVALID_ARGUMENT, "bad", MediaDecodeFailed("bad")),
                    _failed(grpc.StatusCode.RESOURCE_EXHAUSTED, "too large"),
                )
            ]
        finally:
            await link.close()

    assert asyncio.run(run()) == [
        E.ERROR_CODE_SCHEDULER_UNAVAILABLE,
        E.ERROR_CODE_SCHEDULER_UNAVAILABLE,
        E.ERROR_CODE_INTERNAL,
        E.ERROR_CODE_MEDIA_DECODE_FAILED,
        E.ERROR_CODE_INTERNAL,
    ]


def test_media_fail_over_only_to_a_backend_that_takes_their_rows_as_made(tmp_path: Path) -> None:
    """The rows a request's media were made in for its backend
    (`SchedulerLink.row_form`: an image's frame once, and the model's dtype,
    as the backend's ServerInfo says it takes them) go on failover only to a
    backend that would be sent the same (`Schedulers.pick(form=...)`);
    without media (no form) any ready backend will do."""
    from types import SimpleNamespace

    from mmsplit.common.v1 import common_pb2
    from tokenizer_svc.downstream import Schedulers
    from tokenizer_svc.preprocess import PLAIN_ROWS, RowForm

    said = {  # address: (one_frame_image_rows, encoder_input_dtype)
        "127.0.0.1:1": (False, common_pb2.DTYPE_UNSPECIFIED),  # from before either
        "127.0.0.1:2": (True, common_pb2.DTYPE_FLOAT32),
        "127.0.0.1:3": (True, common_pb2.DTYPE_FLOAT32),
        "127.0.0.1:4": (True, common_pb2.DTYPE_BFLOAT16),
    }
    qwen, llava = SimpleNamespace(image_frames=2), SimpleNamespace(image_frames=1)

    async def run() -> tuple[list[list[str]], list[RowForm]]:
        settings = TokenizerSettings(model_dir=tmp_path, scheduler=",".join(said))
        backends = Schedulers(settings, ClientSecurity())
        try:
            links = backends.links
            for address, (one_frame, dtype) in said.items():
                links[address].info = common_pb2.ServerInfo(one_frame_image_rows=one_frame, encoder_input_dtype=dtype)
                links[address].transport = common_pb2.TRANSPORT_SHM
            forms = [links[a].row_form(family) for a in said for family in (qwen, llava)]
            one_frame = RowForm(one_frame=True)
            picked = []
            for exclude, form in (
                (["127.0.0.1:2"], one_frame),
                (["127.0.0.1:2", "127.0.0.1:3"], one_frame),
                (["127.0.0.1:2", "127.0.0.1:3"], PLAIN_ROWS),
                ([], RowForm(one_frame=True, dtype="bfloat16")),
                (["127.0.0.1:4"], RowForm(dtype="bfloat16")),
                (["127.0.0.1:2", "127.0.0.1:3", "127.0.0.1:4"], None),
            ):
                out = [links[a] for a in exclude]
                chosen = [backends.pick(out, common_pb2.TRANSPORT_SHM, form=form) for _ in range(8)]
                picked.append(sorted({"-" if link is None else link.target for link in chosen}))
            return picked, forms
        finally:
            for link in backends.links.values():
                await link.close()

    picked, forms = asyncio.run(run())
    # Float32 rows of every frame go anywhere; bfloat16 ones only to a bfloat16 model.
    assert picked == [
        ["127.0.0.1:3", "127.0.0.1:4"],
        ["127.0.0.1:4"],
        ["127.0.0.1:1", "127.0.0.1:4"],
        ["127.0.0.1:4"],
        ["-"],
        ["127.0.0.1:1"],
    ]
    assert forms == [
        PLAIN_ROWS,
        PLAIN_ROWS,
        RowForm(one_frame=True),
        PLAIN_ROWS,
        RowForm(one_frame=True),
        PLAIN_ROWS,
        RowForm(one_frame=True, dtype="bfloat16"),
        RowForm(dtype="bfloat16"),
    ]


def test_a_server_that_is_no_scheduler_is_named_once_and_a_scheduler_not_serving_is_not(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`--scheduler` at another gRPC server (a tokenizer's port, say): its
    health service does not know the scheduler's, the link's channel finds
    it unhealthy, and the tokenizer used to say only that it was waiting
    for a scheduler there. Now one ERROR names what answers, and no other
    however many looks; a real scheduler that says NOT_SERVING (starting,
    draining) gets none."""

    async def looks(serving: dict[str, health_pb2.HealthCheckResponse.ServingStatus.ValueType]) -> list[str]:
        checker = health.aio.HealthServicer()
        for name, status in serving.items():
            await checker.set(name, status)
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(checker, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        link = SchedulerLink(
            TokenizerSettings(model_dir=tmp_path, runtime_dir=str(tmp_path / "run")),
            ClientSecurity(),
            f"127.0.0.1:{port}",
        )
        caplog.clear()
        try:
            for _ in range(4):
                assert await link.refresh() is False
        finally:
            await link.close()
            await server.stop(None)
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]

    with caplog.at_level(logging.INFO, logger="tokenizer_svc.downstream"):
        another = asyncio.run(looks({"mmsplit.tokenizer.v1.TokenizerService": health_pb2.HealthCheckResponse.SERVING}))
        assert len(another) == 1, another
        assert "answers, but is not a scheduler (its health service knows no mmsplit.scheduler.v1" in another[0]
        assert "--scheduler names another server" in another[0]
        starting = asyncio.run(
            looks({"mmsplit.scheduler.v1.SchedulerService": health_pb2.HealthCheckResponse.NOT_SERVING})
        )
        assert starting == []


def test_a_dns_target_follows_its_answers_and_keeps_a_backend_until_its_requests_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dns:///NAME:PORT` (a Kubernetes headless service): each resolution
    adds the addresses that appeared and removes those that went, except
    one that still carries this tokenizer's requests, removed at a later
    pass once they have ended; a resolution that fails changes nothing."""
    answers: list[list[str] | OSError] = [
        ["10.0.0.1", "10.0.0.2"],
        OSError("no answer"),
        ["10.0.0.1"],
        ["10.0.0.3"],
        ["10.0.0.3"],
    ]

    async def run() -> list[list[str]]:
        async def getaddrinfo(host: str, port: int, **_: object) -> list[tuple[object, ...]]:
            assert host == "sched.example"
            answer = answers.pop(0)
            if isinstance(answer, OSError):
                raise answer
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in answer]

        monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", getaddrinfo)
        backends = Schedulers(
            TokenizerSettings(model_dir=tmp_path, scheduler="dns:///sched.example:50051"), ClientSecurity()
        )
        seen = []
        try:
            for step in range(5):
                await backends._resolve()
                seen.append(sorted(backends.links))
                if step == 2:
                    backends.links["10.0.0.1:50051"].inflight = 1  # a request on it when it leaves the answers
                elif step == 3:
                    backends.links["10.0.0.1:50051"].inflight = 0
        finally:
            for link in backends.links.values():
                await link.close()
        return seen

    assert asyncio.run(run()) == [
        ["10.0.0.1:50051", "10.0.0.2:50051"],
        ["10.0.0.1:50051", "10.0.0.2:50051"],  # the failed resolution
        ["10.0.0.1:50051"],
        ["10.0.0.1:50051", "10.0.0.3:50051"],  # .1 gone from the answers, its request still running
        ["10.0.0.3:50051"],
    ]
