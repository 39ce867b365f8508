"""Every model family through real servers at TP=2: greedy tokens equal
single-process `generate` with the model's own processor, with several
requests of the family decoded in the same batch (which catches a rope delta
shared between requests); and malformed items sent straight to the
scheduler are refused one by one while the group keeps serving."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from mmsplit.common.v1 import common_pb2
from mmsplit.errors import RemoteError
from mmsplit.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from mmsplit.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mmsplit_cli import samples
from mmsplit_cli.client import make_request, run_request
from tests.conftest import SCHEDULER_SERVICE, TOKENIZER_SERVICE, Services
from tests.e2e.helpers import (
    health_status,
    kept_of_one_image,
    kit_rows_bytes,
    png,
    rank_active_requests,
    scheduler_info,
    sent_together,
    the_group_went_on,
    tokenizer_info,
)
from tests.support import family_kit, greedy, hf_family, video_corpus
from tests.support.leaks import PROJECT_PREFIX, project_segments, wait_until
from tests.support.local_token import scheduler_channel
from tests.support.services import Pair, running_pair

pytestmark = pytest.mark.e2e
MAX_TOKENS = 6
# The families whose pairs prefill prompts of over 32 tokens in chunks of 32.
CHUNKED = ("qwen2-vl", "qwen3-vl", "internvl")


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """The pairs' allowed media directory (a video named clip.png in it),
    their TMPDIR, which must stay as it is, and where their workers say
    they began a SLOW frame (tests.support.worker_hook)."""
    media, tmp = tmp_path_factory.mktemp("family-media"), tmp_path_factory.mktemp("family-tmp")
    (media / "clip.png").write_bytes(samples.video(frames=8))
    return media, tmp, tmp_path_factory.mktemp("family-slow")


@pytest.fixture(
    scope="module", params=["llava", "llava-next", "qwen2-vl", "qwen2.5-vl", "qwen3-vl", "internvl", "internvl3.5"]
)
def family_pair(
    request: pytest.FixtureRequest,
    family_models: Callable[[str], Path],
    services: Services,
    family_dirs: tuple[Path, Path, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, Pair]]:
    """Each family's pair at TP=2 (LLaVA-1.5 is the session's shared pair);
    the others slow down frames of the worker hook's SLOW size. Qwen2-VL's,
    Qwen3-VL's and InternVL's prefill prompts of over 32 tokens in chunks of
    32, a step each (with their M-RoPE positions and encoder outputs,
    Qwen3-VL's DeepStack features included, cut to match); Qwen2.5-VL's
    prefills them whole, batched."""
    family = request.param
    if family == "llava":
        yield family, services
        return
    logs = tmp_path_factory.mktemp(f"logs-{family}")
    media, tmp, slow = family_dirs
    with running_pair(
        family_models(family),
        logs,
        scheduler_extra=[
            "--engine-hook",
            "tests.support.faults",
            "--batch-window-s",
            "0.05",
            *(["--max-prefill-tokens", "32", "--log-level", "DEBUG"] if family in CHUNKED else []),
        ],
        tokenizer_extra=["--worker-hook", "tests.support.worker_hook", "--allowed-media-dir", str(media)],
        env={"TMPDIR": str(tmp), "MMSPLIT_TEST_SLOW_DIR": str(slow)},
    ) as pair:
        yield family, pair
        codes = {"tokenizer": pair.tokenizer.stop(), "scheduler": pair.scheduler.stop()}
    assert codes == {"tokenizer": 0, "scheduler": 0}, f"services exited with {codes}"


VIDEO_FAMILIES = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl", "internvl", "internvl3.5")


def n_choices_of_a_long_prompt(pair: Pair, family: str, asks: list[greedy.Ask], outs: list[greedy.Outcome]) -> None:
    """A media ask sent for n = 3 greedy choices, under a salt of its own (no
    cached prefix): its prompt is prefilled in chunks, and a choice that
    reaches the scheduler in the same step, or while those chunks are under
    way, takes a copy (each rank logs it; a new salt each try until one
    did, as they do unless the tokenizer's work spreads them past the
    chunks); every choice makes the model's tokens."""
    log = pair.scheduler.log_path
    said = "take the chunked prefill of an identical prompt"

    def lines() -> list[str]:
        return [line for line in log.read_text().splitlines() if said in line]

    before = len(lines())
    i = next(k for k, parts in enumerate(asks) if any(isinstance(p, tuple) for p in parts))
    images, videos = greedy.media(asks[i], "image"), greedy.media(asks[i], "video")
    with grpc.insecure_channel(pair.tokenizer_address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        for attempt in range(6):
            request = make_request(greedy.prompt(family, asks[i]), images, videos=videos, max_tokens=MAX_TOKENS)
            request.n, request.cache_salt = 3, f"n choices {attempt}"
            choices: dict[int, list[int]] = {}
            for event in stub.Generate(request, timeout=120):
                if event.HasField("delta"):
                    choices.setdefault(event.index, []).extend(event.delta.token_ids)
            assert choices == {k: list(outs[i].token_ids) for k in range(3)}, (family, attempt, choices)
            if len(lines()) - before >= 2:  # rank 0's line and rank 1's
                break
        else:
            pytest.fail(f"{family}: in 6 tries no choice joined while another's chunks were under way")
    assert {line.split("rank ")[1][0] for line in lines()[before:]} == {"0", "1"}, (family, lines()[before:])


def test_greedy_tokens_equal_the_model_in_one_batch(family_pair: tuple[str, Pair]) -> None:
    """`greedy.asks` of the family at once, each equal to the model's own
    `generate` (`greedy.equal_to_the_model`); then sent again, from the
    caches."""
    family, pair = family_pair
    wide, tall, square = png(120, 200, 1), png(300, 90, 2), png(224, 224, 3)
    asks = greedy.asks(family, video=family in VIDEO_FAMILIES, images=(wide, tall, square))
    outs = greedy.equal_to_the_model(family, pair, asks, max_tokens=MAX_TOKENS)
    if family in CHUNKED:
        chunked = [line for line in pair.scheduler.log_path.read_text().splitlines() if "prefilled in chunks" in line]
        media_asks = sum(1 for parts in asks if any(isinstance(p, tuple) for p in parts))
        assert len(chunked) >= 2 * min(4, media_asks), "the media asks were not prefilled in chunks (a line per rank)"
        n_choices_of_a_long_prompt(pair, family, asks, outs)

    # Sent again, one at a time, under another cache_salt (so no block of
    # the prefix cache serves them): the items' encoder outputs come from
    # the scheduler's encoder cache (counted), and the tokens are the same.
    again = [0, 4] if family in VIDEO_FAMILIES else [0]
    hits_before = scheduler_info(pair.scheduler_address).encoder_cache_hits
    with grpc.insecure_channel(pair.tokenizer_address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        for i in again:
            parts = asks[i]
            prompt = greedy.prompt(family, parts)
            images, videos = greedy.media(parts, "image"), greedy.media(parts, "video")
            request = make_request(prompt, images, videos=videos, max_tokens=MAX_TOKENS)
            request.cache_salt = "another tenant"
            repeat = run_request(stub, request, timeout=120)
            assert repeat.token_ids == outs[i].token_ids, (family, parts)
            assert repeat.cached_tokens == 0, "a salt of its own shares no block"
        hits = scheduler_info(pair.scheduler_address).encoder_cache_hits - hits_before
        assert hits == len(again), (family, hits)
        # A prompt with text after its image, twice: the second takes the
        # first's blocks through the image from the prefix cache (the same
        # on both ranks) and makes the same tokens.
        prompt = (
            family_kit.MARKERS[family]
            + " Tell me all about this picture: its colors, its shapes, its light, in long sentences."
        )
        first, second = (run_request(stub, make_request(prompt, [square], max_tokens=MAX_TOKENS)) for _ in range(2))
        assert first.ok, first
        assert second.token_ids == first.token_ids, family
        assert second.cached_tokens > max(first.cached_tokens, 63), (family, first.cached_tokens, second.cached_tokens)
    assert wait_until(lambda: rank_active_requests(pair.scheduler_address) == [0, 0], timeout=10)


def _outcome(stub: scheduler_pb2_grpc.SchedulerServiceStub, message: scheduler_pb2.GenerateRequest) -> str:
    try:
        events = list(stub.Generate(message, timeout=60))
    except grpc.RpcError as exc:
        return RemoteError.from_rpc_error(exc).reason
    assert events[-1].HasField("finished")
    return "ok"


def _malformed(kit: family_kit.Kit, good: scheduler_pb2.GenerateRequest) -> dict[str, scheduler_pb2.GenerateRequest]:
    """Named corruptions of a valid two-image request."""
    cases: dict[str, scheduler_pb2.GenerateRequest] = {}

    def variant(name: str) -> scheduler_pb2.GenerateRequest:
        message = scheduler_pb2.GenerateRequest()
        message.CopyFrom(good)
        message.request_id = f"bad-{name}"
        cases[name] = message
        return message

    m = variant("unknown tensor name")
    m.items[0].tensors["labels"].CopyFrom(family_kit.inline(np.zeros((1, 2), dtype=np.int64)))
    m = variant("run out of range")
    m.items[1].placeholders[0].offset = len(good.input_ids) - 1
    m = variant("runs overlap")
    m.items[1].placeholders[0].offset = m.items[0].placeholders[0].offset + 1
    m = variant("run of wrong length")
    m.items[0].placeholders[0].length -= 1
    m = variant("run not on placeholders")
    m.items[0].placeholders[0].offset -= 1
    m = variant("both pixel_values and items")
    m.pixel_values.append(family_kit.inline(np.zeros((3, 8, 8), dtype=np.float32)))
    m = variant("side tensor by shared memory")
    name = next((n for n in m.items[0].tensors if not n.startswith("pixel_values")), "")  # LLaVA, InternVL: none
    if name:
        ref = m.items[0].tensors[name]
        ref.shm.CopyFrom(common_pb2.ShmSlice(segment=f"{PROJECT_PREFIX}-1-abc", offset=0, nbytes=len(ref.inline)))
    else:
        del cases["side tensor by shared memory"]
    if kit.family.name.startswith("qwen"):
        # The grid disagrees with the patch rows sent.
        m = variant("grid disagrees with rows")
        grid = np.frombuffer(m.items[0].tensors["image_grid_thw"].inline, dtype=np.int64).reshape(1, 3).copy()
        grid[0, 1] += 2
        m.items[0].tensors["image_grid_thw"].CopyFrom(family_kit.inline(grid))
        m = variant("two items' runs touch (read as one M-RoPE block)")
        first, second = m.items[0].placeholders[0], m.items[1].placeholders[0]
        ids = list(good.input_ids[: first.offset])
        ids += [good.input_ids[first.offset]] * (first.length + second.length) + [good.input_ids[-1]]
        del m.input_ids[:]
        m.input_ids.extend(ids)
        second.offset = first.offset + first.length
        m = variant("rows of neither width (all frames', one frame's)")
        ref = m.items[0].tensors["pixel_values"]
        rows = np.frombuffer(ref.inline, dtype=np.float32).reshape(tuple(ref.shape))
        ref.CopyFrom(family_kit.inline(np.ascontiguousarray(rows[:, : rows.shape[1] * 3 // 4])))
        m = variant("odd grid")
        grid[0, 1] -= 3
        m.items[0].tensors["image_grid_thw"].CopyFrom(family_kit.inline(grid))
    if kit.family.name == "llava-next":
        m = variant("image_sizes disagree with views")
        m.items[0].tensors["image_sizes"].CopyFrom(family_kit.inline(np.array([[224, 224]], dtype=np.int64)))
    return cases


def test_a_request_s_bound_on_an_image_s_tiles_is_internvl_s_alone(family_pair: tuple[str, Pair]) -> None:
    """`image_budget.max_tiles` (vLLM's `max_dynamic_patch`): an InternVL
    image cut into at most that many tiles, its tokens transformers' with
    that `max_patches`; any other family refuses it, naming the field, and
    serves the next request. GetServerInfo says the checkpoint's bounds."""
    from tokenizer_svc.decode import decode_image

    family, pair = family_pair
    wide = png(300, 120, 4)
    prompt = f"{family_kit.MARKERS[family]} What is this?"
    # The checkpoint's bounds, as GetServerInfo says them (the tiny InternVL's processor: 1 to 4).
    info = tokenizer_info(pair.tokenizer_address).info
    assert (info.image_min_tiles, info.image_max_tiles) == ((1, 4) if family.startswith("internvl") else (0, 0))
    with grpc.insecure_channel(pair.tokenizer_address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        outs, prompts = {}, {}
        for most in (0, 1):
            request = make_request(prompt, [wide], max_tokens=MAX_TOKENS)
            if most:
                request.image_budget.max_tiles = most
            outs[most] = run_request(stub, request, timeout=120)
            if outs[most].ok:
                asked = tokenizer_pb2.TokenizeRequest(request=request)
                prompts[most] = len(stub.Tokenize(asked, timeout=60).token_ids)
        assert outs[0].ok, outs[0]
        if not family.startswith("internvl"):
            assert (outs[1].reason, outs[1].metadata.get("param")) == ("INVALID_REQUEST", "image_budget.max_tiles")
            assert run_request(stub, make_request(prompt, [wide], max_tokens=2), timeout=120).ok
            return
    assert outs[1].ok, outs[1]
    per_tile = 16  # the tiny model's 112-pixel tiles
    # The checkpoint's up to 4 tiles and a thumbnail (3 here, a 5:2 image), then one.
    assert prompts[0] - prompts[1] == 3 * per_tile, prompts
    proc = hf_family.processor(pair.model)
    text = proc.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " What is this?"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    image = decode_image(wide, max_pixels=10**8)
    expected, _ = hf_family.scored(pair.model, proc, text, [image], MAX_TOKENS, images_kwargs={"max_patches": 1})
    assert outs[1].token_ids == expected


def test_malformed_items_are_refused_and_the_group_keeps_serving(family_pair: tuple[str, Pair]) -> None:
    from PIL import Image

    _, pair = family_pair
    kit = family_kit.kit(pair.model)
    images = [Image.open(io.BytesIO(png(120, 200, 4))), Image.open(io.BytesIO(png(90, 300, 5)))]
    good = kit.message("good", f"Here: {kit.marker} and {kit.marker}", images, max_tokens=2)
    with scheduler_channel(pair.scheduler_address) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        outcomes = {name: _outcome(stub, m) for name, m in _malformed(kit, good).items()}
        assert outcomes == dict.fromkeys(outcomes, "INVALID_REQUEST"), outcomes
        assert _outcome(stub, good) == "ok"
    assert health_status(pair.scheduler_address, SCHEDULER_SERVICE) == "SERVING"
    assert health_status(pair.tokenizer_address, TOKENIZER_SERVICE) == "SERVING"
    assert wait_until(lambda: rank_active_requests(pair.scheduler_address) == [0, 0], timeout=10)


def test_an_image_s_rows_of_one_frame_give_the_tokens_of_all_its_frames(family_pair: tuple[str, Pair]) -> None:
    """Qwen: the same images sent straight to the scheduler (both ranks) as
    rows of every frame and as rows of one frame (which it says it takes,
    and the tokenizer sends it) give the same tokens: each rank repeats the
    frame before the vision tower. Other families' rows hold the frame once:
    the same message either way."""
    from PIL import Image

    family, pair = family_pair
    kit = family_kit.kit(pair.model)
    images = [Image.open(io.BytesIO(png(120, 200, 4))), Image.open(io.BytesIO(png(300, 90, 5)))]
    text = f"Compare {kit.marker} with {kit.marker}, please."
    whole, one = (kit.message(rid, text, images, MAX_TOKENS, one_frame=rid == "one") for rid in ("whole", "one"))
    if not family.startswith("qwen"):
        one.request_id = "whole"
        assert one == whole
        return
    assert scheduler_info(pair.scheduler_address).one_frame_image_rows
    for m in (whole, one):
        m.sampling.min_tokens = MAX_TOKENS  # no early end: every step compared
    widths = [m.items[0].tensors["pixel_values"].shape[1] for m in (whole, one)]
    assert widths[0] == 2 * widths[1], widths
    with scheduler_channel(pair.scheduler_address) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        tokens = [_token_ids(stub, m) for m in (whole, one)]
    assert len(tokens[0]) == MAX_TOKENS, tokens
    assert tokens[0] == tokens[1], tokens
    # The tokenizer makes and sends such rows: what it keeps of a new image.
    assert kept_of_one_image(pair, kit, png(210, 140, 6)) == kit_rows_bytes(kit, png(210, 140, 6), one_frame=True)
    assert wait_until(lambda: rank_active_requests(pair.scheduler_address) == [0, 0], timeout=10)


def _token_ids(stub: scheduler_pb2_grpc.SchedulerServiceStub, message: scheduler_pb2.GenerateRequest) -> list[int]:
    events = list(stub.Generate(message, timeout=60))
    assert events[-1].HasField("finished"), events[-1]
    return [t for e in events if e.HasField("tokens") for t in e.tokens.token_ids]


def test_a_prefill_that_raises_on_one_rank_fails_that_request_alone(family_pair: tuple[str, Pair]) -> None:
    """A long prompt whose prefill forward raises on rank 1 only, inside the
    model (the fault hook, between two TP sums), fails alone with a typed
    error while 8 others decode beside it and keep the tokens they make
    alone; the group keeps its processes. Qwen2-VL's pair prefills it in
    chunks of 32 tokens, a step each: the chunk's failure is agreed on."""
    family, pair = family_pair
    pid = pair.scheduler.pid
    topics = ["rain", "bread", "rivers", "maps", "owls", "glass", "tides", "salt"]
    goods = [make_request(f"Say something about {t}.", max_tokens=8, min_tokens=8) for t in topics]
    long_text = "Tell me everything you know about " + ", ".join(topics * 5) + "."
    with grpc.insecure_channel(pair.tokenizer_address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        alone = [run_request(stub, good, timeout=120).token_ids for good in goods]
        doomed = make_request(long_text, max_tokens=8, request_id=f"inject-forward-failure-rank1-{family}")
        *together, failed = sent_together(stub, [*goods, doomed])
        assert [out.token_ids for out in together] == alone
        assert all(out.ok for out in together), together
        assert (failed.grpc_code, failed.reason) == ("INTERNAL", "INTERNAL"), failed
        assert "the model failed on this request in" in failed.message, failed
        if family in CHUNKED:
            assert "a chunk of its prefill" in failed.message, failed
        assert run_request(stub, goods[0], timeout=120).token_ids == alone[0]
    the_group_went_on(pair, pid)


def _media_outcome(stub: tokenizer_pb2_grpc.TokenizerServiceStub, request: tokenizer_pb2.GenerateRequest) -> str:
    out = run_request(stub, request, timeout=60)
    return "ok" if out.ok else out.reason


def test_video_corpus_has_its_documented_outcomes_and_leaves_nothing(
    family_pair: tuple[str, Pair], family_dirs: tuple[Path, Path, Path]
) -> None:
    """Every corpus video through the tokenizer: its documented outcome
    (models without video: MEDIA_UNSUPPORTED each), a video named like an
    image, and on qwen2-vl the command line's --video and a request
    cancelled while its video decodes; then no segment and no temporary
    file is left, the next request succeeds, health SERVING."""
    from tests.support.worker_hook import SLOW

    family, pair = family_pair
    takes_video = family in VIDEO_FAMILIES
    before = sorted(os.listdir(family_dirs[1]))
    cases = video_corpus.corpus()
    # Decoding, its limits, the command line and a cancel mid-decode are the
    # same code for every family that takes video: qwen2-vl runs all of
    # them; the others a third of the cases (which keeps the suite's time:
    # the cancel alone waits out ~5 s of slow frames). A model without video
    # refuses each case before decoding it.
    every = family == "qwen2-vl" or family not in VIDEO_FAMILIES
    if not every:
        cases = cases[::3]
    with grpc.insecure_channel(pair.tokenizer_address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)

        def ask(*, videos: list[tokenizer_pb2.Video] = (), images: list[tokenizer_pb2.Image] = ()) -> str:
            request = tokenizer_pb2.GenerateRequest(prompt="What happens?", videos=videos, images=images)
            request.sampling.max_tokens = 2
            return _media_outcome(stub, request)

        outcomes = {case.name: ask(videos=[tokenizer_pb2.Video(data=case.data)]) for case in cases}
        expected = {case.name: case.expected if takes_video else "MEDIA_UNSUPPORTED" for case in cases}
        assert outcomes == expected
        if takes_video:
            # A video named like an image: read by content as a video; as an image it is not one.
            assert ask(videos=[tokenizer_pb2.Video(url="clip.png")]) == "ok"
            assert ask(images=[tokenizer_pb2.Image(url="clip.png")]) == "MEDIA_UNSUPPORTED"
            clip = (family_dirs[0] / "clip.png").read_bytes()
            assert (
                ask(videos=[tokenizer_pb2.Video(url="data:video/mp4;base64," + base64.b64encode(clip).decode())])
                == "ok"
            )
        if takes_video and every:
            # The command line's --video.
            command = [sys.executable, "-m", "mmsplit_cli", "generate", "--server", pair.tokenizer_address]
            done = subprocess.run(
                [*command, "--json", "--max-tokens", "2", "--video", str(family_dirs[0] / "clip.png"), "What?"],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert done.returncode == 0, done.stdout + done.stderr
            assert json.loads(done.stdout.splitlines()[-1])["finished"]["completion_tokens"] == 2
            # Cancelled mid-decode: each sampled frame of this size takes the worker 1.5 s.
            slow = tokenizer_pb2.GenerateRequest(
                prompt="Slow:",
                videos=[tokenizer_pb2.Video(data=samples.video(frames=12, width=SLOW[0], height=SLOW[1]))],
            )
            marks = set(family_dirs[2].iterdir())
            call = stub.Generate(slow, timeout=60)
            # Cancelled once a worker has begun its first slow frame.
            assert wait_until(lambda: set(family_dirs[2].iterdir()) - marks, timeout=30), "no worker began the video"
            call.cancel()
            with pytest.raises(grpc.RpcError) as cancelled:
                list(call)
            assert cancelled.value.code() == grpc.StatusCode.CANCELLED
            # The worker cannot be interrupted: it finishes the frames, writes
            # the item, and the abandoned result's segment is released.
            pair.tokenizer.wait_logged("of abandoned preprocessing task", timeout=30)
        assert ask() == "ok"
    assert wait_until(lambda: not _segments_of(pair), timeout=30), _segments_of(pair)
    assert sorted(os.listdir(family_dirs[1])) == before
    assert health_status(pair.tokenizer_address, TOKENIZER_SERVICE) == "SERVING"
    assert wait_until(lambda: rank_active_requests(pair.scheduler_address) == [0, 0], timeout=10)


def _segments_of(pair: Pair) -> list[str]:
    """Segments the pair's tokenizer made (named <prefix>-<pid>-<random>)."""
    return [name for name in project_segments() if name.split("-")[1:2] == [str(pair.tokenizer.pid)]]
