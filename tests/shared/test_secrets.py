"""Credentials that rotate without a restart (`mmsplit_server.serving.SecretFile`):
the file read again when it changes, a server taking any of its secrets (the
scheduler's token interceptor over real gRPC, the HTTP API's keys through
the openai SDK), a client presenting the first, and a bad rewrite keeping
the secrets read last."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any

import grpc
import pytest

from mmsplit_server.serving import ClientSecurity, SecretFile, ServerSecurity


def _write(path: Path, text: str) -> None:
    """As a Kubernetes Secret volume updates: a new file swapped in."""
    fresh = path.with_suffix(".new")
    fresh.write_text(text)
    os.replace(fresh, path)


def test_a_secret_file_is_read_again_when_it_changes_and_a_bad_rewrite_keeps_the_last(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "keys"
    path.write_text("old-key\n")
    keys = SecretFile(str(path))
    assert keys.secrets() == ("old-key",)
    _write(path, "# rotating\nnew-key\n\n  old-key  \n")
    assert (keys.secrets(), keys.first()) == (("new-key", "old-key"), "new-key")
    with path.open("a") as f:  # edited in place
        f.write("third\n")
    assert keys.secrets() == ("new-key", "old-key", "third")
    for broken in ("", "# only a comment\n"):
        _write(path, broken)
        with caplog.at_level(logging.ERROR):
            assert keys.secrets() == ("new-key", "old-key", "third")
    path.unlink()
    assert keys.secrets() == ("new-key", "old-key", "third")
    assert sum("could not be read again" in r.getMessage() for r in caplog.records) == 1  # said once
    _write(path, "newest\n")
    assert keys.secrets() == ("newest",)
    for bad in ("", "# nothing\n"):
        _write(path, bad)
        with pytest.raises(ValueError, match="holds no secret"):
            SecretFile(str(path))
    with pytest.raises(FileNotFoundError):
        SecretFile(str(tmp_path / "missing"))


def test_a_server_takes_every_token_of_its_file_and_a_client_sends_its_first(tmp_path: Path) -> None:
    """A real gRPC server behind the token interceptor: a call bears the
    first token of the client's file, the server takes any of its file's,
    and both follow their files as they change."""
    server_file, client_file = tmp_path / "server", tmp_path / "client"
    server_file.write_text("old\n")
    client_file.write_text("old\n")

    async def run() -> list[str]:
        client = ClientSecurity.with_token_file(str(client_file))
        server = grpc.aio.server(interceptors=ServerSecurity.with_token_file(str(server_file)).interceptors())
        echo = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", {"Echo": echo}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        outcomes: list[str] = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.unary_unary("/test.Echo/Echo")

                async def once() -> str:
                    try:
                        await call(b"hi", metadata=client.metadata(), timeout=10)
                        return "OK"
                    except grpc.aio.AioRpcError as exc:
                        return exc.code().name

                outcomes.append(await once())  # sends old; takes old
                _write(client_file, "new\n")
                outcomes.append(await once())  # new; old: refused
                _write(server_file, "new\nold\n")
                outcomes.append(await once())  # new; new, old
                _write(client_file, "old\n")
                outcomes.append(await once())  # old; new, old
                _write(server_file, "new\n")
                outcomes.append(await once())  # old; new: refused
        finally:
            await server.stop(None)
        return outcomes

    assert asyncio.run(run()) == ["OK", "UNAUTHENTICATED", "OK", "OK", "UNAUTHENTICATED"]


def test_http_api_keys_rotate_without_a_restart(tmp_path: Path) -> None:
    """--api-key-file with two keys during a rotation: both work (the
    openai SDK), then only the one left in the file."""
    import openai

    from mmsplit.tokenizer.v1 import tokenizer_pb2 as pb
    from tokenizer_svc.http_api import HttpApi, start

    path = tmp_path / "api-keys"
    path.write_text("key-a\n")

    class Answers:
        tokenizer = None

        async def generate(self, request: Any, rid: str, timeout_s: Any, client: str = "") -> Any:
            yield pb.GenerateResponse(delta=pb.TextDelta(text="hi"))
            yield pb.GenerateResponse(finished=pb.Finished(finish_reason=1, prompt_tokens=1, completion_tokens=1))

    async def run() -> list[str]:
        api = HttpApi(Answers(), model="m", ready=lambda: True, max_body_bytes=1 << 20, api_keys=SecretFile(str(path)))  # type: ignore[arg-type]
        runner, port = await start(api, "127.0.0.1", 0)
        outcomes = []

        async def ask(key: str) -> str:
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
            try:
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
                return "OK"
            except openai.AuthenticationError:
                return "401"
            finally:
                await client.close()

        try:
            outcomes += [await ask("key-a"), await ask("key-b")]
            _write(path, "key-b\nkey-a\n")
            outcomes += [await ask("key-a"), await ask("key-b")]
            _write(path, "key-b\n")
            outcomes += [await ask("key-a"), await ask("key-b")]
        finally:
            await runner.cleanup()
        return outcomes

    assert asyncio.run(run()) == ["OK", "401", "OK", "OK", "401", "OK"]
