"""A family's asks sent at once through a running pair, each answer checked
against the model's own single-process `generate` with its processor:
the same greedy tokens, and each token's log probability within float noise
of the model's (equal tokens alone can hide a small error: a random model's
top two are often far apart, while a video numbered as text, for one, is
off by ~1e-3 in every log probability)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from mmsplit.tokenizer.v1 import tokenizer_pb2_grpc
from mmsplit_cli import samples
from mmsplit_cli.client import Outcome, make_request, run_request
from tests.support import family_kit, hf_family
from tests.support.logprobs import LOGPROB_TOLERANCE
from tests.support.services import Pair

VIDEO_MARKER = "<|vision_start|><|video_pad|><|vision_end|>"

Ask = list[Any]  # parts: text, or ("image" | "video", bytes)


def asks(family: str, *, video: bool, images: tuple[bytes, bytes, bytes]) -> list[Ask]:
    """Text only, one image, two images, an image last; with `video` a short
    video (2 s at 6 fps) and a video between two images."""
    wide, tall, square = images
    out: list[Ask] = [
        ["USER: ", ("image", wide), "\nWhat is in the image? ASSISTANT:"],
        [("image", tall), " versus ", ("image", square), ": which is taller?"],
        ["Tell me a story about a lighthouse."],
        ["Look: ", ("image", square)],
    ]
    if video:
        clip, other = samples.video(frames=12, seed=1), samples.video(frames=9, width=120, height=90, fps=3, seed=2)
        out += [
            ["Watch: ", ("video", clip), " What moves?"],
            [("image", wide), " and ", ("video", other), " and ", ("image", tall), ": same colors?"],
        ]
    return out


def prompt(family: str, parts: Ask) -> str:
    """The ask as a prompt: its text, each medium as the family's marker."""
    markers = {"image": family_kit.MARKERS[family], "video": family_kit.VIDEO_MARKERS.get(family, VIDEO_MARKER)}
    return "".join(markers[p[0]] if isinstance(p, tuple) else p for p in parts)


def media(parts: Ask, kind: str) -> list[bytes]:
    return [p[1] for p in parts if isinstance(p, tuple) and p[0] == kind]


def equal_to_the_model(family: str, pair: Pair, asked: list[Ask], *, max_tokens: int) -> list[Outcome]:
    """Send every ask at once (so they share steps: joins and decodes of
    different requests, and different rope deltas, in the same batches) and
    check each answer against the model's. The prompt sent marks each medium
    where it goes; the reference renders the same parts as one user turn with
    the processor's own chat template when the model ships one (the Qwen and
    InternVL tiny models do: the default `--chat-template auto` applies it), else uses the
    prompt as written."""
    from tokenizer_svc.decode import decode_image

    barrier = threading.Barrier(len(asked))
    with grpc.insecure_channel(pair.tokenizer_address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)

        def send(parts: Ask) -> Outcome:
            request = make_request(
                prompt(family, parts), media(parts, "image"), videos=media(parts, "video"), max_tokens=max_tokens
            )
            request.sampling.logprobs = True
            barrier.wait()
            return run_request(stub, request, timeout=120)

        with ThreadPoolExecutor(len(asked)) as pool:
            outs = list(pool.map(send, asked))
    proc = hf_family.processor(pair.model)
    assert bool(proc.chat_template) == family_kit.ships_template(family)
    for parts, out in zip(asked, outs, strict=True):
        assert out.ok, (family, parts, out)
        decoded = [decode_image(b, max_pixels=10**8) for b in media(parts, "image")]
        # The services' sampling defaults: the model's fps and frame bounds.
        clips = [hf_family.video_inputs(pair.model, v, fps=2.0, max_frames=32) for v in media(parts, "video")]
        if proc.chat_template:
            content = [{"type": p[0]} if isinstance(p, tuple) else {"type": "text", "text": p} for p in parts]
            turn = [{"role": "user", "content": content}]
            text = proc.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
        else:
            text = prompt(family, parts)
        expected, logprobs = hf_family.scored(pair.model, proc, text, decoded, max_tokens, clips)
        assert out.token_ids == expected, (family, parts)
        assert out.logprobs == pytest.approx(logprobs, abs=LOGPROB_TOLERANCE), (family, parts)
    return outs
