"""Qwen3-VL: Qwen2.5-VL's items and M-RoPE, DeepStack, and timestamped video.

Items are Qwen2-VL's (flattened patches of 16 pixels and a (t, h, w)
grid; an item fills ``t*h*w / merge²`` placeholders) and positions come
from the model's own `get_rope_index`, as in `qwen2_vl`. What differs:

- The encoder's output: besides the merged patches it hands the language
  model, the vision tower gives DeepStack features from some of its layers
  (`vision_config.deepstack_visual_indexes`), which the first layers of the
  language model add at the item's placeholders. An item's encoder output,
  as the scheduler caches and slices it, is therefore ``[placeholders, (1 +
  levels) * hidden]``: the merged patches, then each level's features, side
  by side (`encoded_width`); a chunk of a long prompt takes the rows of its
  placeholders from all of them.
- A video is one run per temporal patch (two frames), each preceded by its
  time, inside the marker's own start and end, as transformers' (5.x)
  processor writes it: ``<|vision_start|><0.3 seconds><|vision_start|>
  <|video_pad|>...<|vision_end|><1.3 seconds><|vision_start|>...
  <|vision_end|><|vision_end|>`` (`expand`; transformers 4.x and vLLM drop
  the outer pair); `get_rope_index` numbers each run as a one-frame
  block. The frames are sampled from the first to the last
  (`frame_sampling`) and all resized to one size chosen for the whole clip:
  its frames' pixels together within the video processor's bounds
  (`sized_frames`).

Qwen3-VL-MoE (`qwen3_vl_moe`) is the same with a mixture-of-experts text
model; over TP ranks its experts are loaded whole on every rank
(`tp_plan_overrides`), then split by the scheduler (`scheduler_svc.experts`).
"""

from __future__ import annotations

from typing import Any

from mmsplit_server.families.base import IMAGE, VIDEO, BadItem, Family
from mmsplit_server.families.qwen2_vl import QwenVL, placeholders

MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe")
# The video processor's pixel bounds for a whole clip when the checkpoint names none (transformers' defaults).
DEFAULT_VIDEO_SIZE = {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}


class Qwen3VL(QwenVL):
    patch_default = 16

    @property
    def levels(self) -> int:
        """DeepStack's levels: the vision layers whose features join the text model's."""
        return len(self.vision.get("deepstack_visual_indexes") or ())

    def rules(self) -> dict[str, Any]:
        return {**super().rules(), "deepstack_levels": self.levels}

    def encoded_width(self, hidden: int) -> int:
        return hidden * (1 + self.levels)

    @property
    def frame_sampling(self) -> str:
        return "spread"

    def tp_plan_overrides(self) -> dict[str, str]:
        """Qwen3-VL-MoE: its experts loaded whole on every rank. transformers
        (5.23) cannot load them split (their down_proj is cut along the
        checkpoint's layout, not the model's: a size mismatch); the
        scheduler splits them once loaded (`splits_experts_after_load`),
        while attention and the rest are split as the model's plan says."""
        if self.model_type != "qwen3_vl_moe":
            return {}
        experts = "model.language_model.layers.*.mlp.experts"
        return dict.fromkeys((experts, f"{experts}.gate_up_proj", f"{experts}.down_proj"), "replicate")

    @property
    def splits_experts_after_load(self) -> bool:
        return self.model_type == "qwen3_vl_moe"

    def expand(self, modality: int, tokens: int, times: tuple[float, ...] = ()) -> str:
        if modality != VIDEO:
            return super().expand(modality, tokens, times)
        if not times or tokens % len(times):
            raise BadItem(f"a video of {tokens} placeholders cannot be written as {len(times)} timed runs")
        holder = self.placeholders[VIDEO]
        run = holder.expand(tokens // len(times))
        # transformers (5.x) replaces the marker's inner <|video_pad|> only: the outer start and end stay.
        return holder.before + "".join(f"<{seconds:.1f} seconds>{run}" for seconds in times) + holder.after

    def item_runs(self, item: Any) -> int:
        """A video fills one run per temporal patch; an image one."""
        return int(item.side["video_grid_thw"][0][0]) if item.modality == VIDEO else 1

    def sized_frames(self, frames: list[Any]) -> tuple[list[Any], dict[str, Any]]:
        """Every frame resized (PIL, bicubic) to the size transformers'
        Qwen3-VL video processor picks for the clip: a multiple of patch x
        merge whose pixels over all frames lie within the processor's bounds
        (per frame with ``cap_pixels_per_frame``). A clip of fewer frames than
        a temporal patch is sized as one patch (transformers refuses it)."""
        from PIL import Image
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

        config = self.video_config
        size = dict(config.get("size") or DEFAULT_VIDEO_SIZE)
        factor = int(self.vision.get("patch_size", self.patch_default)) * self.merge
        n = max(len(frames), self.temporal_patch_size)
        most = int(size["longest_edge"])
        if config.get("cap_pixels_per_frame"):
            cap = int(config.get("max_video_tokens", 768)) * factor * factor
            most = max(min(cap, most // n), int(size["shortest_edge"] * 1.05)) * n
        width, height = frames[0].size
        h, w = smart_resize(
            num_frames=n,
            height=height,
            width=width,
            temporal_factor=self.temporal_patch_size,
            factor=factor,
            min_pixels=int(size["shortest_edge"]),
            max_pixels=most,
        )
        resized = [f if f.size == (w, h) else f.resize((w, h), Image.Resampling.BICUBIC) for f in frames]
        return resized, {"do_resize": False}

    def encode(self, body: Any, modality: int, items: list[dict[str, Any]]) -> list[Any]:
        import torch

        out = self.vision_output(body, modality, items)
        # Per item: its merged patches and each level's features, side by side.
        return [
            torch.cat([main, *levels], dim=1)
            for main, *levels in zip(out.pooler_output, *out.deepstack_features, strict=True)
        ]

    def encoded_kwargs(self, features: list[tuple[int, Any]]) -> dict[str, Any]:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

        outputs: dict[str, Any] = {}
        for kind, modality in (("image", IMAGE), ("video", VIDEO)):
            parts = [output.chunk(1 + self.levels, dim=1) for m, output in features if m == modality]
            if parts:
                outputs[kind] = BaseModelOutputWithDeepstackFeatures(
                    pooler_output=[p[0] for p in parts],  # type: ignore[arg-type]  # a list, one per item, as the forward reads
                    deepstack_features=[[p[1 + level] for p in parts] for level in range(self.levels)],  # type: ignore[misc]
                )
        return {"mm_encoder_outputs": outputs}


def build(model_type: str, config: dict[str, Any], processor_config: dict[str, Any], names: frozenset[str]) -> Family:
    name = "qwen3-vl-moe" if model_type == "qwen3_vl_moe" else "qwen3-vl"
    return Qwen3VL(
        name=name, model_type=model_type, placeholders=placeholders(config), input_names=names, config=config
    )
