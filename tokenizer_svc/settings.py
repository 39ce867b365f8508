"""Settings of the tokenizer service. Built once by the CLI (flags with
MMSPLIT_* environment fallbacks, see `mmsplit_cli.config`) and passed down;
nothing else reads the environment. Each field's `help` is its documentation."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def _opt(default: T, help: str) -> T:
    result: T = field(default=default, metadata={"help": help})
    return result


@dataclass(frozen=True)
class TokenizerSettings:
    model_dir: Path = field(
        metadata={"help": "local checkpoint directory (its processor is loaded)", "flag": "--model"}
    )
    scheduler: str = _opt("127.0.0.1:50051", "scheduler address HOST:PORT")
    host: str = _opt("127.0.0.1", "address to serve gRPC on")
    port: int = _opt(0, "port to serve gRPC on; 0 picks a free one (logged)")
    shm_prefix: str = _opt("mmsplit", "prefix of the shared-memory segments this service creates")
    cpu_workers: int = _opt(2, "processes decoding and preprocessing images")
    io_threads: int = _opt(16, "threads fetching remote images")
    preprocess_timeout_s: float = _opt(10.0, "CPU budget of one image's decode + preprocessing (fetching excluded)")
    fetch_timeout_s: float = _opt(5.0, "timeout of one fetch attempt")
    fetch_retries: int = _opt(2, "extra attempts after a timeout, connection error or 5xx")
    fetch_backoff_s: float = _opt(0.2, "first retry delay; doubles per attempt, with jitter")
    max_image_bytes: int = _opt(20 * 1024 * 1024, "largest encoded image, bytes")
    max_image_pixels: int = _opt(40_000_000, "largest decoded image, width x height (checked before decoding)")
    max_aspect_ratio: float = _opt(
        50.0, "longest side / shortest side accepted (a 1x20000 strip would resize into gigabytes)"
    )
    max_images_per_request: int = _opt(8, "images one request may carry")
    max_prompt_chars: int = _opt(100_000, "longest prompt, characters")
    max_tokens_limit: int = _opt(
        4096, "largest sampling.max_tokens accepted (the scheduler applies its own limit as well)"
    )
    allowed_media_dir: str = _opt("", "images given as file paths must lie under this directory; empty = none allowed")
    allow_private_fetch: bool = _opt(False, "allow fetching from loopback/private addresses (tests, demos)")
    allowed_domains: str = _opt(
        "", "comma-separated domains images may be fetched from (subdomains included); empty = any public host"
    )
    private_fetch_exempt: str = _opt(
        "", "comma-separated HOST:PORT destinations exempt from the private-address guard (a sidecar, a test origin)"
    )
    max_inflight: int = _opt(256, "requests in progress; beyond this, OVERLOADED at once")
    janitor_interval_s: float = _opt(30.0, "how often orphaned segments of the prefix are swept")
    segment_lease_s: float = _opt(
        300.0, "a segment of the prefix older than this, and not held by a request here, is an orphan"
    )
    scheduler_wait_s: float = _opt(120.0, "how long startup waits for the scheduler before serving NOT_SERVING")
    shutdown_grace_s: float = _opt(5.0, "seconds running requests get to finish on SIGTERM")
    max_message_bytes: int = _opt(64 * 1024 * 1024, "largest gRPC message")
    worker_hook: str = _opt(
        "", "module imported by each CPU worker: on_worker_start(), on_decoded(image) (tests inject faults with it)"
    )
    log_level: str = _opt("INFO", "logging level")
