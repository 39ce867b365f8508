"""Settings of the scheduler service. Built once by the CLI (flags with
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
class SchedulerSettings:
    model_dir: Path = field(metadata={"help": "local checkpoint directory (LLaVA family)", "flag": "--model"})
    tp: int = _opt(1, "number of tensor-parallel ranks")
    host: str = _opt("127.0.0.1", "address to serve gRPC on")
    port: int = _opt(0, "port to serve gRPC on; 0 picks a free one (logged)")
    launch: str = _opt(
        "local",
        "'local': this process is rank 0 and spawns ranks 1..tp-1 here; 'env': this process is the rank "
        "that torch's env:// rendezvous names (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), for ranks on "
        "several pods; only rank 0 serves gRPC",
    )
    device: str = _opt("auto", "'auto' (CUDA with NCCL when present, else CPU with gloo), 'cpu' or 'cuda'")
    dtype: str = _opt(
        "auto", "model dtype: 'auto' (float32 on CPU, bfloat16 on CUDA), 'float32', 'bfloat16', 'float16'"
    )
    shm_prefix: str = _opt("mmsplit", "prefix of the shared-memory segment names accepted")
    max_tensor_bytes: int = _opt(64 * 1024 * 1024, "largest tensor (and segment) accepted, bytes")
    max_images_per_request: int = _opt(8, "images one request may carry")
    max_new_per_step: int = _opt(32, "new requests admitted into one step; the rest wait")
    max_running: int = _opt(64, "requests generating at once (rows of the batch)")
    max_queue: int = _opt(256, "accepted requests waiting for room; beyond this, OVERLOADED at once")
    max_prefill_tokens: int = _opt(
        4096,
        "tokens of one step's batched prefill (joining requests x their longest prompt); a longer "
        "prompt is prefilled alone",
    )
    kv_cache_bytes: int = _opt(
        4 * 1024**3, "KV-cache memory per rank; the token budget is derived from it and the model's shape"
    )
    kv_budget_tokens: int = _opt(
        0,
        "KV-cache budget in tokens (rows x the longest reservation; a request reserves prompt + "
        "max_tokens); 0 = derived from --kv-cache-bytes",
    )
    default_max_tokens: int = _opt(64, "max_tokens of a request that leaves it 0")
    max_tokens_limit: int = _opt(4096, "largest max_tokens accepted")
    batch_window_s: float = _opt(
        0.002, "when idle, how long rank 0 waits after a first arrival for others to join the same step"
    )
    heartbeat_s: float = _opt(
        1.0, "when idle, rank 0 still runs an empty step this often so no rank's collective times out"
    )
    startup_timeout_s: float = _opt(300.0, "how long ranks wait for each other to start")
    collective_timeout_s: float = _opt(60.0, "a collective slower than this fails the group instead of hanging")
    tensor_reader: str = _opt(
        "",
        "'module:factory' building each rank's tensor reader (scheduler_svc/reader.py); empty = shared memory/inline",
    )
    janitor_interval_s: float = _opt(30.0, "how often segments of the prefix past their lease are swept")
    segment_lease_s: float = _opt(
        300.0, "a segment of the prefix older than this, and not held by a queued request, is an orphan"
    )
    shutdown_grace_s: float = _opt(5.0, "seconds running requests get to finish on SIGTERM")
    max_message_bytes: int = _opt(256 * 1024 * 1024, "largest gRPC message")
    stats_interval_s: float = _opt(10.0, "how often the step loop logs its statistics")
    log_level: str = _opt("INFO", "logging level")
