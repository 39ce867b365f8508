"""Start-up checks made before anything heavy is imported or loaded (torch,
transformers, the weights): each problem is one line that names the setting
and says what to do, and the service exits 2 without a traceback.

- `--model` is a local directory holding a config.json of a supported
  family; a Hugging Face Hub id is refused with how to download it (the
  services load local checkpoints only: no hub access is assumed);
- a scheduler's `--model` holds weights (a tokenizer needs none);
- the TP size divides the text model's attention and key-value heads
  (transformers' tensor parallelism gives each rank whole heads: any other
  size fails inside the model's first forward, on every rank);
- the ports the service will bind are free (found before minutes of loading,
  not after).
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

from mmsplit_server import families

# owner/name, as the Hub spells a repository: not a path anyone would mean.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def model_problem(model: Path) -> str:
    """What is wrong with `--model` (empty when nothing is)."""
    text = str(model)
    if not model.exists():
        if _HUB_ID.match(text):
            return (
                f"--model {text}: no such directory; it looks like a Hugging Face Hub id, and mmsplit loads local "
                f"checkpoints only: download it first (hf download {text} --local-dir DIR) and give DIR"
            )
        return f"--model {text}: no such directory (give a local checkpoint directory)"
    if not model.is_dir():
        return f"--model {text}: not a directory (give a local checkpoint directory)"
    config = model / "config.json"
    if not config.is_file():
        return f"--model {text}: not a model directory (it has no config.json)"
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as exc:
        return f"--model {text}: its config.json cannot be read: {exc}"
    supported = families.supported()
    if model_type not in supported:
        return (
            f"--model {text}: model type {model_type!r} is not supported; mmsplit serves "
            f"{', '.join(sorted(supported))} (multimodal models with an image encoder)"
        )
    return ""


def weights_problem(model: Path) -> str:
    """Whether `model` holds weights transformers can load (empty when it
    does): the scheduler loads them; a tokenizer needs none."""
    if any(model.glob("*.safetensors")) or any(model.glob("pytorch_model*.bin")):
        return ""
    return (
        f"--model {model}: no weights in it (no *.safetensors, no pytorch_model*.bin): a download of the "
        "configuration and tokenizer only? The scheduler needs the checkpoint's weights"
    )


def tp_problem(model: Path, tp: int, flag: str = "--tp") -> str:
    """Whether a group of `tp` ranks can shard the model at `model` (empty
    when it can, or when its config has no head counts to check): each rank
    takes whole attention heads and whole key-value heads."""
    if tp <= 1:
        return ""
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return ""  # model_problem says what is wrong with it
    text = config.get("text_config") or config  # Qwen2-VL's older configs keep it at the top level
    heads = text.get("num_attention_heads") if isinstance(text, dict) else None
    if not isinstance(heads, int) or heads < 1:
        return ""
    kv_heads = text.get("num_key_value_heads") or heads
    if heads % tp == 0 and kv_heads % tp == 0:
        return ""
    sizes = [n for n in range(1, max(heads, kv_heads) + 1) if heads % n == 0 and kv_heads % n == 0]
    return (
        f"{flag} {tp}: the text model has {heads} attention heads and {kv_heads} key-value heads, and each rank "
        f"takes whole heads of both: pick a TP size that divides both ({', '.join(map(str, sizes))})"
    )


def port_problem(host: str, port: int, flag: str) -> str:
    """Whether `host:port` can be bound now (empty when it can, or port 0)."""
    if not port:
        return ""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return f"{flag} {port}: {host}:{port} cannot be bound ({exc.strerror}): stop what holds it, or pick another"
    return ""


def first_problem(
    model: Path, ports: list[tuple[str, int, str]], tp: tuple[int, str] = (1, "--tp"), *, weights: bool = False
) -> str:
    """The first problem of the model directory (with `weights`: its
    weights too), the group's size (its ranks, and the setting that gave
    it) and the (host, port, flag) ports."""
    return (
        model_problem(model)
        or (weights_problem(model) if weights else "")
        or tp_problem(model, *tp)
        or next((p for h, port, f in ports if (p := port_problem(h, port, f))), "")
    )
