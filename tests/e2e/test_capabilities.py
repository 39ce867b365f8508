"""A reference is a capability, not a name (`mmsplit_server.handoff.grants`), proven
through real servers: the hostile review's reproduction (a direct scheduler
call naming a slab page another request holds, which used to be Accepted and
described the victim's pixels) is refused, and so are the same attack on a
one-off segment and the replay of a finished request's real reference.

One scheduler whose batch has one row, busy with a long request, so that a
victim's image request waits in its queue with its pixels held; two
tokenizers in front of it, one writing into its slab, one writing a segment
per tensor (`--shm-slab-bytes 0`)."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from mmsplit.common.v1 import common_pb2
from mmsplit.errors import RemoteError
from mmsplit.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from mmsplit.tokenizer.v1 import tokenizer_pb2_grpc
from mmsplit_cli import samples
from mmsplit_cli.client import Outcome, make_request, run_request
from mmsplit_cli.launch import ServiceProcess, tokenizer_args
from mmsplit_cli.tiny_model import IMAGE_SIZE
from mmsplit_server.handoff import grants, ranges
from scheduler_svc.model import model_info
from tests.conftest import HOLDING_LIMIT, HOLDING_TOKENS, TOKENIZER_SERVICE
from tests.e2e.helpers import health_status, scheduler_info, tokenizer_info
from tests.support.leaks import PROJECT_PREFIX, wait_until
from tests.support.local_token import scheduler_channel
from tests.support.services import ENV, running_pair

pytestmark = pytest.mark.e2e
F32 = common_pb2.DTYPE_FLOAT32
SHAPE = [3, IMAGE_SIZE, IMAGE_SIZE]  # one image of a tiny LLaVA (the legacy pixel_values field)
NBYTES = 3 * IMAGE_SIZE * IMAGE_SIZE * 4
REFUSED = "the reference is not granted by its sender (forged, or its request has ended)"


def segments_of(pid: int) -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"{PROJECT_PREFIX}-{pid}-")}


def live_grant(table: str, segment: str, offsets: range) -> tuple[grants.Grant, int]:
    """The live entry of `table` for a tensor at one of `offsets` of
    `segment`, and that offset: read from /dev/shm by this test, which runs
    as the services' user, standing in for someone who saw the reference on
    the internal hop."""
    data = Path(f"/dev/shm/{table}").read_bytes()
    for index in range(len(data) // grants.ENTRY):
        at = index * grants.ENTRY
        tag, digest = data[at : at + 16], data[at + 16 : at + 32]
        if any(tag):
            for offset in offsets:
                if grants.location_digest(segment, offset, NBYTES) == digest:
                    return grants.Grant(table, index, tag), offset
    raise AssertionError("the victim's reference is not granted")


def direct(address: str, ref: common_pb2.TensorRef, input_ids: list[int]) -> RemoteError | None:
    """One direct scheduler call carrying `ref`; its error (None when it ran)."""
    request = scheduler_pb2.GenerateRequest(
        request_id=f"forged-{uuid.uuid4().hex[:8]}",
        input_ids=input_ids,
        pixel_values=[ref],
        sampling=common_pb2.SamplingParams(max_tokens=1),
    )
    with scheduler_channel(address) as channel:
        try:
            list(scheduler_pb2_grpc.SchedulerServiceStub(channel).Generate(request, timeout=60))
        except grpc.RpcError as exc:
            return RemoteError.from_rpc_error(exc)
    return None


def ref_to(segment: str, offset: int, grant: grants.Grant | None) -> common_pb2.TensorRef:
    ref = common_pb2.TensorRef(
        dtype=F32, shape=SHAPE, shm=common_pb2.ShmSlice(segment=segment, offset=offset, nbytes=NBYTES)
    )
    if grant is not None:
        ref.grant.CopyFrom(common_pb2.Grant(table=grant.table, index=grant.index, tag=grant.tag))
    return ref


@contextlib.contextmanager
def a_victim_waiting(tokenizer: str, scheduler: str) -> Iterator[Future[Outcome]]:
    """A long text request holds the scheduler's one row; an image request
    (the victim) waits in its queue, its pixels held for it. Yields the
    victim's outcome, which comes once the long request is cancelled on
    leaving."""
    with grpc.insecure_channel(tokenizer) as channel, ThreadPoolExecutor(1) as pool:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        # min_tokens: the running request holds the row until it is cancelled
        # (the model's context is long enough: `long_context_model`).
        holding = make_request("Go on.", max_tokens=HOLDING_TOKENS, min_tokens=HOLDING_TOKENS)
        long = stub.Generate(holding, timeout=300)
        assert next(iter(long)).HasField("delta")
        victim = pool.submit(run_request, stub, make_request("Describe.", [samples.good_png(seed=7)], max_tokens=4))
        try:
            assert wait_until(lambda: scheduler_info(scheduler).queued_requests == 1, timeout=60)
            yield victim
        finally:
            long.cancel()
            victim.result(timeout=120)


def test_forged_and_replayed_references_read_nothing_and_pin_nothing(long_context_model: Path, tmp_path: Path) -> None:
    model = long_context_model  # a request that holds the scheduler's one row until cancelled: `a_victim_waiting`
    input_ids = [1, *([model_info(model).image_token_id] * model_info(model).tokens_per_image), 22557]
    extra = ["--preprocess-cache-bytes", "0", *HOLDING_LIMIT]
    with running_pair(
        model, tmp_path, scheduler_extra=["--tp", "1", "--max-running", "1", *HOLDING_LIMIT], tokenizer_extra=extra
    ) as pair:
        # The victim's own tokens, from a run nobody interferes with.
        with grpc.insecure_channel(pair.tokenizer_address) as channel:
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
            alone = run_request(stub, make_request("Describe.", [samples.good_png(seed=7)], max_tokens=4))
        assert alone.ok, alone
        segments_tok = ServiceProcess(
            "tokenizer",
            tokenizer_args(model, pair.scheduler_address, extra=[*extra, "--shm-slab-bytes", "0"]),
            tmp_path / "segments-tokenizer.log",
            env=ENV,
        )
        try:
            segments_tok.wait_serving(TOKENIZER_SERVICE, 180)

            # 1. A slab slice another request holds.
            pid = pair.tokenizer.pid
            with a_victim_waiting(pair.tokenizer_address, pair.scheduler_address) as victim:
                (slab_name,) = {n for n in segments_of(pid) if "-slab" in n}
                (table,) = {n for n in segments_of(pid) if "-grant" in n}
                size = tokenizer_info(pair.tokenizer_address).info.shm_slab_bytes
                real, victim_page = live_grant(table, slab_name, range(0, size, ranges.PAGE))
                before = scheduler_info(pair.scheduler_address)
                attempts = {
                    "no grant, the victim's page": ref_to(slab_name, victim_page, None),
                    "a guessed tag, the victim's page": ref_to(
                        slab_name, victim_page, grants.Grant(table, real.index, os.urandom(16))
                    ),
                    "the victim's tag, the next page": ref_to(slab_name, victim_page + ranges.PAGE, real),
                    "a guessed tag, a free page": ref_to(
                        slab_name, size - 8 * ranges.PAGE, grants.Grant(table, real.index, os.urandom(16))
                    ),
                }
                said = {what: direct(pair.scheduler_address, ref, input_ids) for what, ref in attempts.items()}
                for what, error in said.items():
                    assert error is not None, f"{what}: accepted"
                    assert error.reason == "INVALID_REQUEST", (what, error)
                # The words refusing a grant are the same for a busy page and a free one: no oracle.
                assert {said[w].message for w in attempts if "tag" in w} == {REFUSED}  # type: ignore[union-attr]
                after = scheduler_info(pair.scheduler_address)
                assert after.encoder_cache_hits == before.encoder_cache_hits, "a forged call read the victim's pixels"
                assert after.encoder_cache_misses == before.encoder_cache_misses, "a forged call read pixels"
                assert after.queued_requests == 1, "a forged call was queued"
            out = victim.result()
            assert out.ok, out
            assert out.token_ids == alone.token_ids, "the victim did not get its own tokens"
            # Replayed once its request has ended: the grant has ended with it.
            error = direct(pair.scheduler_address, ref_to(slab_name, victim_page, real), input_ids)
            assert error is not None
            assert (error.reason, error.message) == ("INVALID_REQUEST", REFUSED)
            # Nothing pinned: the slab's pages are all free once the calls are over.
            assert wait_until(lambda: tokenizer_info(pair.tokenizer_address).info.shm_slab_used_bytes == 0, 10)

            # 2. A one-off segment another request holds.
            with a_victim_waiting(segments_tok.address, pair.scheduler_address) as victim:
                (table,) = {n for n in segments_of(segments_tok.pid) if "-grant" in n}
                (segment,) = segments_of(segments_tok.pid) - {table}
                real, _ = live_grant(table, segment, range(1))
                for forged in (None, grants.Grant(table, real.index, os.urandom(16))):
                    error = direct(pair.scheduler_address, ref_to(segment, 0, forged), input_ids)
                    assert error is not None
                    assert error.reason == "INVALID_REQUEST", error
                assert segment in segments_of(segments_tok.pid), "a refused call removed the victim's segment"
            out = victim.result()
            assert out.ok, out
            assert out.token_ids == alone.token_ids
            error = direct(pair.scheduler_address, ref_to(segment, 0, real), input_ids)
            assert error is not None
            assert (error.reason, error.message) == ("INVALID_REQUEST", REFUSED)
            assert wait_until(lambda: segments_of(segments_tok.pid) == {table}, timeout=10)
            assert health_status(pair.tokenizer_address, TOKENIZER_SERVICE) == "SERVING"
        finally:
            assert segments_tok.stop() == 0
