"""The reference for every model family: the model's own Hugging Face
processor and single-process `generate`, on the same text and images.

The Qwen and InternVL processors cannot be constructed here as shipped: their video
processor needs torchvision, which does not import beside this torch. It is
built from the directory's tokenizer and image processor with the video
processor left out (only its class check is skipped); images and text go
through exactly the code a user of transformers runs.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import torch

from tests.support import hf_loaded


@hf_loaded.once_per_files
def processor(model_dir: Path) -> Any:
    """The model's processor (shared: loaded once per test process and directory)."""
    from transformers import AutoProcessor, processing_utils

    model_type = json.loads((model_dir / "config.json").read_text())["model_type"]
    if model_type not in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "internvl"):
        return AutoProcessor.from_pretrained(model_dir)
    from transformers import InternVLProcessor, Qwen2_5_VLProcessor, Qwen2VLProcessor, Qwen3VLProcessor

    cls = {
        "qwen2_vl": Qwen2VLProcessor,
        "qwen2_5_vl": Qwen2_5_VLProcessor,
        "qwen3_vl": Qwen3VLProcessor,
        "qwen3_vl_moe": Qwen3VLProcessor,
        "internvl": InternVLProcessor,
    }[model_type]
    own = {}
    if model_type == "internvl":  # InternVLProcessor's own setting (the others have none), from the directory
        own["image_seq_length"] = json.loads((model_dir / "processor_config.json").read_text())["image_seq_length"]
    check = processing_utils.ProcessorMixin.check_argument_for_proper_class
    processing_utils.ProcessorMixin.check_argument_for_proper_class = (  # type: ignore[method-assign]
        lambda self, name, arg: None if arg is None else check(self, name, arg)
    )
    tokenizer = hf_loaded.tokenizer(model_dir)
    try:
        return cls(
            image_processor=hf_loaded.image_processor(model_dir),
            tokenizer=tokenizer,
            video_processor=None,
            # What from_pretrained reads from the directory's chat_template.jinja.
            chat_template=tokenizer.chat_template,
            **own,
        )
    finally:
        processing_utils.ProcessorMixin.check_argument_for_proper_class = check  # type: ignore[method-assign]


def prompt_ids(proc: Any, text: str, images: list[Any]) -> list[int]:
    out = proc(images=images or None, text=text, return_tensors="pt")
    return out["input_ids"][0].tolist()


def generate(
    model_dir: Path, proc: Any, text: str, images: list[Any], max_tokens: int, videos: list[dict[str, Any]] = ()
) -> list[int]:
    """Greedy tokens of single-process `generate` (EOS as the model directory
    says). `videos`: `video_inputs` of each video, in prompt order."""
    return scored(model_dir, proc, text, images, max_tokens, videos)[0]


def scored(
    model_dir: Path,
    proc: Any,
    text: str,
    images: list[Any],
    max_tokens: int,
    videos: list[dict[str, Any]] = (),
    size: dict[str, int] | None = None,
    images_kwargs: dict[str, Any] | None = None,
) -> tuple[list[int], list[float]]:
    """`generate`'s tokens and each one's log probability (log-softmax of the
    model's logits, before any processing). `size`: the image processor's
    for this call (a Qwen model's pixel budget); `images_kwargs`, other
    keywords of the processor's call for its images (InternVL's max_patches)."""
    model = hf_loaded.model(model_dir)
    if videos and type(proc).__name__ == "InternVLProcessor":
        inputs = _internvl_with_videos(proc, text, images, videos)
    elif videos:
        inputs = _with_videos(proc, text, images, videos)
    else:
        own = {**({"size": size} if size else {}), **(images_kwargs or {})}
        inputs = dict(proc(images=images or None, text=text, return_tensors="pt", **own))
    with torch.inference_mode():
        out = model.generate(
            **inputs, max_new_tokens=max_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    logprobs = [float(torch.log_softmax(step[0].double(), -1)[t]) for step, t in zip(out.logits, tokens, strict=True)]
    return tokens, logprobs


def _with_videos(proc: Any, text: str, images: list[Any], videos: list[dict[str, Any]]) -> dict[str, Any]:
    """What Qwen2-VL's processor does with text, images and videos (its call
    refuses videos without a video processor): each ``<|image_pad|>`` and
    ``<|video_pad|>`` becomes one per merged patch of its item (Qwen3-VL: a
    video's ``<|video_pad|>`` becomes what its processor's
    `replace_video_token` writes, timed runs), then one tokenizer call."""
    import re

    merge = proc.image_processor.merge_size**2
    out: dict[str, Any] = {}
    grids: dict[str, list[Any]] = {"<|image_pad|>": []}
    if images:
        pictures = proc.image_processor(images=images, return_tensors="pt")
        out.update(pictures)
        grids["<|image_pad|>"] = list(pictures["image_grid_thw"])

    def expand_video(video: dict[str, Any]) -> str:
        if "metadata" not in video:
            return "<|video_pad|>" * (int(video["video_grid_thw"][0].prod()) // merge)
        # Qwen3-VL: the processor's own timed runs, from the video's sampled frames.
        from types import SimpleNamespace

        proc.video_processor = SimpleNamespace(merge_size=proc.image_processor.merge_size, temporal_patch_size=2)
        try:
            inputs = {"video_grid_thw": video["video_grid_thw"], "video_metadata": [video["metadata"]]}
            return str(proc.replace_video_token(inputs, 0))
        finally:
            proc.video_processor = None

    queue = list(videos)

    def expand(match: re.Match[str]) -> str:
        if match.group(0) == "<|video_pad|>":
            return expand_video(queue.pop(0))
        grid = grids[match.group(0)].pop(0)
        return match.group(0) * (int(grid.prod()) // merge)

    text = re.sub(r"<\|image_pad\|>|<\|video_pad\|>", expand, text)
    for name in videos[0]:
        if name != "metadata":
            out[name] = torch.cat([v[name] for v in videos])
    out.update(proc.tokenizer(text, return_tensors="pt"))
    # What the processor's call adds and M-RoPE needs: without it `generate`
    # numbers a prompt's vision tokens as text (1-D positions, no rope delta).
    out["mm_token_type_ids"] = torch.tensor(proc.create_mm_token_type_ids(out["input_ids"].tolist()))
    return out


def _internvl_with_videos(proc: Any, text: str, images: list[Any], videos: list[dict[str, Any]]) -> dict[str, Any]:
    """What InternVLProcessor's call does with text, images and videos (it
    refuses videos without a video processor), restated: each image's tiles
    from its image processor and its marker as ``<img>`` + a tile's
    placeholders per tile + ``</img>``; each ``<video>`` as its processor's
    `replace_video_token` writes it (a "FrameN: <img>...</img>" line a
    frame); every tile and frame in one `pixel_values`, in prompt order."""
    import re

    tiles: list[Any] = []
    if images:
        pictures = proc.image_processor(images=images, crop_to_patches=True, return_tensors="pt")
        counts = [int(n) for n in pictures["num_patches"]]
        starts = [sum(counts[:k]) for k in range(len(counts))]
        tiles = [pictures["pixel_values"][a : a + n] for a, n in zip(starts, counts, strict=True)]
    images_left, videos_left, pixels = list(tiles), list(videos), []

    def expand(match: re.Match[str]) -> str:
        if match.group(0) == proc.video_token:
            frames = videos_left.pop(0)["pixel_values"]
            pixels.append(frames)
            return str(proc.replace_video_token({"pixel_values_videos": [frames]}, 0))
        picture = images_left.pop(0)
        pixels.append(picture)
        return proc.start_image_token + proc.image_token * proc.image_seq_length * len(picture) + proc.end_image_token

    pattern = f"{re.escape(proc.image_token)}|{re.escape(proc.video_token)}"
    text = re.sub(pattern, expand, text)
    return {**proc.tokenizer(text, return_tensors="pt"), "pixel_values": torch.cat(pixels)}


def _internvl_video(model_dir: Path, data: bytes, *, fps: float, max_frames: int) -> dict[str, Any]:
    """A video's frames as InternVL takes them, restated from its video
    processor (which needs torchvision): every frame decoded to RGB with
    PyAV, `sample_frames` with fps and `initial_shift` (frames in the middle
    of equal parts), each resized to one tile (PIL bicubic here), rescaled
    and normalized with the image processor's mean and deviation (the tiny
    model has no video processor config)."""
    import av
    import numpy as np
    from PIL import Image

    config = json.loads((model_dir / "preprocessor_config.json").read_text())
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        native_fps = float(stream.average_rate)
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
    total = len(frames)
    n = min(max(int(total / native_fps * fps), 4), max_frames, total)
    indices = torch.arange(total / n / 2, total, total / n).int().tolist()
    side = config["size"]["height"]
    mean = torch.tensor(config["image_mean"]).view(3, 1, 1)
    std = torch.tensor(config["image_std"]).view(3, 1, 1)
    resized = [np.array(Image.fromarray(frames[i]).resize((side, side), Image.BICUBIC)) for i in indices]
    return {"pixel_values": torch.stack([(torch.from_numpy(f).permute(2, 0, 1) / 255 - mean) / std for f in resized])}


def video_inputs(model_dir: Path, data: bytes, *, fps: float, max_frames: int) -> dict[str, Any]:
    """A video's forward inputs the way transformers' Qwen2-VL video
    processor makes them (which needs torchvision, so it is restated here):
    every frame decoded to RGB with PyAV, `sample_frames` with fps,
    per-frame smart resize (PIL bicubic here), rescale and normalize, the
    last frame repeated to a whole temporal patch, then its `patchify`.
    Qwen3-VL's processor differs in two steps, restated as it does them:
    frames spread from the first to the last (``linspace``, not rounded to
    whole patches), and one size for the clip from its own `smart_resize`
    over all frames' pixels; its ``metadata`` (for the prompt's times) is
    under that key."""
    import math

    import av
    import numpy as np
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    model_type = json.loads((model_dir / "config.json").read_text())["model_type"]
    if model_type == "internvl":
        return _internvl_video(model_dir, data, fps=fps, max_frames=max_frames)
    config = json.loads((model_dir / "video_preprocessor_config.json").read_text())
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        native_fps = float(stream.average_rate)
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
    tps, patch, merge = config["temporal_patch_size"], config["patch_size"], config["merge_size"]
    total = len(frames)
    size = config["size"]
    if model_type in ("qwen3_vl", "qwen3_vl_moe"):
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as clip_resize
        from transformers.video_utils import VideoMetadata

        n = int(total / native_fps * fps)
        n = min(max(n, config["min_frames"]), min(max_frames, config["max_frames"]), total)
        indices = np.linspace(0, total - 1, n).round().astype(int).tolist()
        picked = [frames[i] for i in indices]
        height, width = picked[0].shape[:2]
        # Fewer frames than a temporal patch: transformers refuses; the services size them as one patch.
        frames_n = max(n, tps)
        rh, rw = clip_resize(frames_n, height, width, tps, patch * merge, size["shortest_edge"], size["longest_edge"])
        metadata = VideoMetadata(total_num_frames=total, fps=native_fps, frames_indices=indices)
    else:
        top = math.floor(min(min(max_frames, config["max_frames"]), total) / tps) * tps
        n = min(max(total / native_fps * fps, config["min_frames"]), top, total)
        n = math.floor(n / tps) * tps
        picked = [frames[i * total // n] for i in range(n)]
        if total < tps:
            picked, n = frames, total  # transformers fails here; the services' documented rule keeps them all
        height, width = picked[0].shape[:2]
        rh, rw = smart_resize(height, width, patch * merge, size["shortest_edge"], size["longest_edge"])
    mean = torch.tensor(config["image_mean"]).view(3, 1, 1)
    std = torch.tensor(config["image_std"]).view(3, 1, 1)
    tensors = [
        (torch.from_numpy(np.array(Image.fromarray(f).resize((rw, rh), Image.BICUBIC))).permute(2, 0, 1) / 255 - mean)
        / std
        for f in picked
    ]
    video = torch.stack(tensors)[None].float()
    b, t, c, h, w = video.shape
    if pad := -t % tps:
        video = torch.cat((video, video[:, -1:].expand(-1, pad, -1, -1, -1)), 1)
        t += pad
    gt, gh, gw = t // tps, h // patch, w // patch
    rows = video.view(b, gt, tps, c, gh // merge, merge, patch, gw // merge, merge, patch)
    rows = rows.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9).reshape(gt * gh * gw, c * tps * patch * patch)
    out = {"pixel_values_videos": rows, "video_grid_thw": torch.tensor([[gt, gh, gw]])}
    if model_type == "qwen2_5_vl":
        out["second_per_grid_ts"] = torch.tensor([tps / (n / total * native_fps)])
    if model_type in ("qwen3_vl", "qwen3_vl_moe"):
        out["metadata"] = metadata
    return out


def with_markers(proc: Any, text: str, n_images: int) -> str:
    """The services' rule for a prompt without image markers (each image
    first, on its own line), applied before handing text to the processor."""
    token = proc.image_token
    if n_images and token not in text:
        wrapped = "<|vision_start|>" + token + "<|vision_end|>" if token == "<|image_pad|>" else token
        text = (wrapped + "\n") * n_images + text
    return text


def inputs(proc: Any, text: str, images: list[Any]) -> dict[str, Any]:
    """What the model's own processor gives for `text` and PIL `images`."""
    out = proc(images=images or None, text=with_markers(proc, text, len(images)), return_tensors="pt")
    return dict(out)
