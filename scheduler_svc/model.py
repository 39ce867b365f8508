"""Loading the model from a local checkpoint directory, with transformers' own
tensor parallelism when the group has more than one rank."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForImageTextToText
from transformers.distributed import DistributedConfig
from transformers.utils import logging as hf_logging

from mmsplit_server import families
from mmsplit_server.families.base import read_json
from mmsplit_server.families.llava import Llava

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """What admission needs to know of the model, read from its config."""

    name: str
    vocab_size: int
    max_context: int
    eos_token_ids: frozenset[int]
    # The text model's shape, for sizing the KV cache.
    num_layers: int
    kv_heads: int
    head_dim: int
    family: families.Family = field(repr=False, compare=False)

    @property
    def image_token_id(self) -> int:
        return self.family.placeholders[families.IMAGE].token_id

    @property
    def image_shape(self) -> tuple[int, ...]:
        """One image's pixel tensor (channels, height, width) in the legacy
        `pixel_values` form: LLaVA-1.5 only, () for other families."""
        f = self.family
        return (f.channels, f.side, f.side) if isinstance(f, Llava) and f.name == "llava" else ()

    @property
    def tokens_per_image(self) -> int:
        """Placeholders of one image in the legacy form (0 when there is none)."""
        return self.family.tokens_per_view() if self.image_shape else 0  # type: ignore[attr-defined]

    def kv_bytes_per_token(self, *, tp: int, itemsize: int) -> int:
        """KV-cache bytes one token takes on one rank (keys and values, every
        layer, this rank's share of the KV heads)."""
        return self.num_layers * 2 * -(-self.kv_heads // tp) * self.head_dim * itemsize


def model_info(model_dir: Path) -> ModelInfo:
    config = AutoConfig.from_pretrained(model_dir)
    family = families.load(model_dir)
    text = config.get_text_config()
    return ModelInfo(
        name=model_dir.name,
        vocab_size=int(text.vocab_size),
        max_context=int(text.max_position_embeddings),
        eos_token_ids=eos_ids(model_dir, config),
        num_layers=int(text.num_hidden_layers),
        kv_heads=int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads),
        head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads),
        family=family,
    )


def eos_ids(model_dir: Path, config: object) -> frozenset[int]:
    """Every end-of-sequence id the checkpoint names: config.json's (top
    level and text config) and generation_config.json's, which is where
    many chat checkpoints put their end-of-turn token."""
    found: set[int] = set()
    generation = read_json(model_dir / "generation_config.json")
    text = config.get_text_config()  # type: ignore[attr-defined]
    for value in (
        getattr(text, "eos_token_id", None),
        getattr(config, "eos_token_id", None),
        generation.get("eos_token_id"),
    ):
        if isinstance(value, int):
            found.add(value)
        elif isinstance(value, list):
            found.update(int(v) for v in value if isinstance(v, int))
    return frozenset(found)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_dtype(setting: str, device: torch.device) -> torch.dtype:
    """The `--dtype` setting: 'auto' is float32 on CPU and bfloat16 on CUDA."""
    if setting == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if setting not in DTYPES:
        raise ValueError(f"--dtype {setting!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[setting]


def load_model(
    model_dir: Path,
    *,
    world_size: int,
    device: torch.device,
    dtype: torch.dtype,
    tp_plan_overrides: dict[str, str] | None = None,
) -> torch.nn.Module:
    """Every rank calls this with the group already initialized.
    `tp_plan_overrides`: the family's (`Family.tp_plan_overrides`), laid
    over the model's own plan when world_size > 1."""
    kwargs: dict[str, object] = {"dtype": dtype}
    if world_size > 1:
        # transformers' own tensor parallelism: the model's predefined plan over
        # the already-initialized default process group.
        plan: dict[str, str] | str = tp_plan_overrides or "auto"  # a dict is laid over the model's own plan
        kwargs["distributed_config"] = DistributedConfig(tp_plan=plan, tp_size=world_size)  # type: ignore[arg-type]
    hf_logging.disable_progress_bar()
    model = AutoModelForImageTextToText.from_pretrained(model_dir, **kwargs)
    if world_size == 1:
        model = model.to(device)  # type: ignore[arg-type]
    model.eval()
    log.info("loaded %s (%s) on %s in %s, tp=%d", model_dir, type(model).__name__, device, dtype, world_size)
    return model
