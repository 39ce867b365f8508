"""Hugging Face tokenizers, image processors, processors and reference
models (float32, eval), loaded once per test process and model directory.

A tiny model's tokenizer takes ~0.5 s of CPU to load (transformers rebuilds
it from the 3.5 MB tokenizer.json's vocabulary and merges), and the suite's
tests load the same few directories' hundreds of times. What is returned is
shared: tests only call these objects, never change them. A directory whose
tokenizer or processor files change (a test's edited copy) loads again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The files a load reads; their sizes and times are part of the key.
_READ = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "config.json",
    "model.safetensors",
)


def _stamp(model_dir: Path) -> tuple[Path, tuple[tuple[str, int, int], ...]]:
    model_dir = Path(model_dir).resolve()
    stats = []
    for name in _READ:
        path = model_dir / name
        if path.exists():
            st = path.stat()
            stats.append((name, st.st_mtime_ns, st.st_size))
    return model_dir, tuple(stats)


def once_per_files(load: Callable[[Path], Any]) -> Callable[[Path], Any]:
    """`load(model_dir)`, called again only for a directory not seen or whose files changed."""
    once = functools.lru_cache(maxsize=32)(lambda key: load(key[0]))
    return functools.wraps(load)(lambda model_dir: once(_stamp(model_dir)))


@once_per_files
def tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@once_per_files
def image_processor(model_dir: Path) -> Any:
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(model_dir)


@once_per_files
def model(model_dir: Path) -> Any:
    """The model as the references run it: float32, eval mode (only called, never changed)."""
    import torch
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
