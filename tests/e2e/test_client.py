"""The client library (`mmsplit.client`) against the real services, and its
retries through gRPC's service config against a tokenizer stand-in that is
unavailable for its first calls."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from mmsplit.client import AsyncClient, Client, Delta, Finished, InvalidRequest, MediaError, Unavailable
from mmsplit.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mmsplit_cli import samples
from mmsplit_cli.client import make_request, run_request
from tests.conftest import Services
from tokenizer_svc.errors import SchedulerUnavailable

pytestmark = pytest.mark.e2e


def test_streams_deltas_then_one_finished_with_the_service_s_tokens(services: Services) -> None:
    with Client(services.tokenizer_address) as client:
        events = list(client.generate("Describe it.", images=[samples.good_png()], max_tokens=5))
        done = client.complete("Describe it.", images=[samples.good_png()], max_tokens=5)
    assert all(isinstance(e, Delta) for e in events[:-1])
    assert isinstance(events[-1], Finished)
    assert events[-1].completion_tokens == 5
    with grpc.insecure_channel(services.tokenizer_address) as channel:
        plain = run_request(
            tokenizer_pb2_grpc.TokenizerServiceStub(channel),
            make_request("Describe it.", [samples.good_png()], max_tokens=5),
        )
    assert done.token_ids == plain.token_ids
    assert done.text == plain.text
    assert done.finish_reason == "LENGTH"


def test_client_errors_are_typed_with_reason_retriable_and_request_id(services: Services) -> None:
    with Client(services.tokenizer_address) as client:
        with pytest.raises(MediaError) as corrupt:
            client.complete("Hi", images=[samples.corrupt_png()], request_id="typed-1")
        with pytest.raises(InvalidRequest) as bad_sampling:
            client.complete("Hi", temperature=-1.0, request_id="typed-2")
        with pytest.raises(MediaError) as forbidden:
            client.complete("Hi", images=["/etc/passwd"], request_id="typed-3")
    assert (corrupt.value.reason, corrupt.value.retriable, corrupt.value.request_id) == (
        "MEDIA_DECODE_FAILED",
        False,
        "typed-1",
    )
    assert corrupt.value.grpc_code == "INVALID_ARGUMENT"
    assert bad_sampling.value.reason == "INVALID_REQUEST"
    assert "temperature" in bad_sampling.value.message
    assert (forbidden.value.reason, forbidden.value.grpc_code) == ("MEDIA_SOURCE_FORBIDDEN", "PERMISSION_DENIED")


def test_tokenize_gives_the_prompt_ids_generation_starts_from(services: Services, tmp_path: Path) -> None:
    """`Tokenize` (the client's `tokenize`, blocking and async): as many ids
    as the generation of the same request reports prompt tokens (its image's
    placeholders counted by its processor), the scheduler's context, and
    Generate's typed errors for what Generate refuses."""
    image = samples.good_png(seed=41)
    with Client(services.tokenizer_address) as client:
        counted = client.tokenize("Describe it.", images=[image])
        done = client.complete("Describe it.", images=[image], max_tokens=2)
        with pytest.raises(MediaError) as corrupt:
            client.tokenize("Hi", images=[samples.corrupt_png()], request_id="tok-1")
        with pytest.raises(InvalidRequest):
            client.tokenize("Hi", temperature=-1.0)
    assert len(counted.ids) == done.prompt_tokens > 20  # an image's placeholders and the text
    assert counted.max_context_tokens > len(counted.ids)
    assert (corrupt.value.reason, corrupt.value.request_id) == ("MEDIA_DECODE_FAILED", "tok-1")

    async def run() -> list[int]:
        async with AsyncClient(services.tokenizer_address) as client:
            return (await client.tokenize("Describe it.", images=[image])).ids

    assert asyncio.run(run()) == counted.ids

    # The command line: `mmsplit generate --tokenize`.
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT

    path = tmp_path / "image.png"
    path.write_bytes(image)
    argv = [sys.executable, "-m", "mmsplit_cli", "generate", "--server", services.tokenizer_address, "--tokenize"]
    done = subprocess.run([*argv, "--json", "--image", str(path), "Describe it."], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, check=True)  # fmt: skip
    assert json.loads(done.stdout) == {
        "count": len(counted.ids),
        "max_context_tokens": counted.max_context_tokens,
        "token_ids": counted.ids,
    }


def test_beam_search_answers_each_beam_best_first(services: Services, tmp_path: Path) -> None:
    """`beam_search` (blocking and async): the beams the contract's
    GenerateRequest.beam_search answers, one Completion each, in order;
    beam search's refusals typed; a length_penalty without a width is the
    caller's error before anything is sent. `mmsplit generate --beams`
    prints the same beams."""
    image = samples.good_png(seed=43)
    with Client(services.tokenizer_address) as client:
        beams = client.beam_search("Describe it.", images=[image], width=3, max_tokens=5, length_penalty=0.5)
        with pytest.raises(InvalidRequest) as refused:
            client.beam_search("Describe it.", width=2, max_tokens=3, stop=["x"])
        with pytest.raises(ValueError, match="beam_width"):
            client.complete("Hi", length_penalty=0.5)
    assert refused.value.message.startswith("sampling.stop cannot go with beam search")
    request = make_request("Describe it.", [image], max_tokens=5)
    request.n = 3
    request.beam_search.length_penalty = 0.5
    raw: dict[int, list[int]] = {}
    with grpc.insecure_channel(services.tokenizer_address) as channel:
        for event in tokenizer_pb2_grpc.TokenizerServiceStub(channel).Generate(request, timeout=60):
            if event.HasField("delta"):
                raw.setdefault(event.index, []).extend(event.delta.token_ids)
    assert [b.token_ids for b in beams] == [raw[i] for i in range(3)]
    assert len({tuple(b.token_ids) for b in beams}) == 3
    assert all(b.finish_reason in ("STOP", "LENGTH") and b.completion_tokens == len(b.token_ids) for b in beams)

    async def run() -> list[list[int]]:
        async with AsyncClient(services.tokenizer_address) as client:
            found = await client.beam_search("Describe it.", images=[image], width=3, max_tokens=5, length_penalty=0.5)
        return [b.token_ids for b in found]

    assert asyncio.run(run()) == [b.token_ids for b in beams]

    # The command line: `mmsplit generate --beams 3`.
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT

    path = tmp_path / "image.png"
    path.write_bytes(image)
    argv = [sys.executable, "-m", "mmsplit_cli", "generate", "--server", services.tokenizer_address, "--json"]
    argv += ["--beams", "3", "--length-penalty", "0.5", "--max-tokens", "5", "--image", str(path), "Describe it."]
    said = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT, check=True).stdout
    assert [json.loads(line)["token_ids"] for line in said.splitlines()] == [b.token_ids for b in beams]
    for flags, says in ((["--beams", "2", "--n", "2"], "not both"), (["--length-penalty", "2"], "give --beams")):
        wrong = subprocess.run([*argv[:7], *flags, "Hi"], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert (wrong.returncode, wrong.stdout) == (2, ""), wrong
        assert says in wrong.stderr, wrong.stderr


def test_choices_answer_each_of_n_sampled_generations(services: Services) -> None:
    """`choices` (blocking and async) and `mmsplit generate --n`: the n
    choices the contract's GenerateRequest.n answers, in order, each its
    own seeded generation; the same seed gives the same choices."""
    ask = {"max_tokens": 6, "temperature": 1.0, "seed": 11}
    with Client(services.tokenizer_address) as client:
        choices = client.choices("Once upon a time", n=3, **ask)
        again = client.choices("Once upon a time", n=3, **ask)
    assert len(choices) == 3
    assert [c.token_ids for c in choices] == [c.token_ids for c in again]
    assert len({tuple(c.token_ids) for c in choices}) > 1, "the choices are independent draws"
    assert all(c.finish_reason in ("STOP", "LENGTH") for c in choices)

    async def run() -> list[list[int]]:
        async with AsyncClient(services.tokenizer_address) as client:
            return [c.token_ids for c in await client.choices("Once upon a time", n=3, **ask)]

    assert asyncio.run(run()) == [c.token_ids for c in choices]
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT

    argv = [sys.executable, "-m", "mmsplit_cli", "generate", "--server", services.tokenizer_address, "--json", "--n"]
    argv += ["3", "--max-tokens", "6", "--temperature", "1", "--seed", "11", "Once upon a time"]
    said = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT, check=True).stdout
    assert [json.loads(line)["token_ids"] for line in said.splitlines()] == [c.token_ids for c in choices]


def test_the_async_client_gives_the_same_tokens(services: Services) -> None:
    async def run() -> tuple[list[int], list[int]]:
        async with AsyncClient(services.tokenizer_address) as client:
            done = await client.complete("Hello", max_tokens=4, seed=3, temperature=0.7)
            again = await client.complete("Hello", max_tokens=4, seed=3, temperature=0.7)
        return done.token_ids, again.token_ids

    first, second = asyncio.run(run())
    assert len(first) == 4
    assert first == second


class _FlakyTokenizer(tokenizer_pb2_grpc.TokenizerServiceServicer):
    """Fails its first `failures` calls as the tokenizer does while its
    scheduler is down (UNAVAILABLE with ErrorInfo SCHEDULER_UNAVAILABLE,
    retriable), then streams one token."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0
        # Each call's grpc-previous-rpc-attempts (what the tokenizer counts retries by).
        self.previous: list[str | None] = []

    async def Generate(
        self, request: tokenizer_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[tokenizer_pb2.GenerateResponse]:
        self.calls += 1
        metadata = dict(context.invocation_metadata() or ())
        self.previous.append(metadata.get("grpc-previous-rpc-attempts"))  # type: ignore[arg-type]
        if self.calls <= self.failures:
            await context.abort_with_status(SchedulerUnavailable("the scheduler is down").to_status("r"))
        yield tokenizer_pb2.GenerateResponse(delta=tokenizer_pb2.TextDelta(text="ok", token_ids=[7]))
        yield tokenizer_pb2.GenerateResponse(finished=tokenizer_pb2.Finished(completion_tokens=1))


def test_retriable_failures_are_retried_by_the_service_config() -> None:
    seen: list[list[str | None]] = []

    async def run(failures: int, retries: int, image: bytes = b"") -> tuple[int, object]:
        flaky = _FlakyTokenizer(failures)
        server = grpc.aio.server()
        tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server(flaky, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with AsyncClient(f"127.0.0.1:{port}", retries=retries, initial_backoff_s=0.05) as client:
                try:
                    images = [image] if image else []
                    outcome: object = await client.complete("Hi", images=images, timeout=20)
                except Unavailable as exc:
                    outcome = exc
        finally:
            await server.stop(None)
        seen.append(flaky.previous)
        return flaky.calls, outcome

    calls, done = asyncio.run(run(failures=2, retries=3))
    assert calls == 3
    assert getattr(done, "token_ids", None) == [7]
    # gRPC marks each retry (the tokenizer's grpc_retried_calls metric counts them).
    assert seen[-1] == [None, "1", "2"]
    # A request far over gRPC's default retry buffer (256 KiB) is retried too.
    calls, done = asyncio.run(run(failures=2, retries=3, image=b"\xff" * (3 << 20)))
    assert calls == 3
    calls, failed = asyncio.run(run(failures=5, retries=1))
    assert calls == 2
    assert isinstance(failed, Unavailable)
    assert (failed.reason, failed.retriable) == ("SCHEDULER_UNAVAILABLE", True)
    calls, failed = asyncio.run(run(failures=1, retries=0))
    assert calls == 1
    assert isinstance(failed, Unavailable)
