"""Settings of the scheduler service. Built once by the CLI (flags with
MMSPLIT_* environment fallbacks, see `mmsplit_cli.config`) and passed down;
nothing else reads the environment. Each field's `help` is its documentation;
ranges and choices are checked when the object is made (`mmsplit_server.settings`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mmsplit_server.serving import is_loopback
from mmsplit_server.settings import ServiceSettings
from mmsplit_server.settings import opt as _opt


@dataclass(frozen=True, kw_only=True)
class SchedulerSettings(ServiceSettings):
    model_dir: Path = field(
        metadata={
            "help": "local checkpoint directory of a supported family (LLaVA-1.5, LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL)",
            "flag": "--model",
        }
    )
    tp: int = _opt(1, "number of tensor-parallel ranks", min=1)
    host: str = _opt(
        "127.0.0.1",
        "address to serve gRPC on; on loopback with no credentials configured, a local token only this user can "
        "read (--runtime-dir) is required; anything else requires mutual TLS or a token (or --insecure)",
    )
    port: int = _opt(
        50051, "port to serve gRPC on (the tokenizer's --scheduler default); 0 picks a free one (logged)", min=0
    )
    auth_token_file: str = _opt(
        "",
        "file of shared tokens, one per line, a call must carry one of (authorization: Bearer <token>); read again "
        "when it changes (tokens rotate without a restart); health is exempt",
    )
    insecure: bool = _opt(False, "serve with neither mutual TLS nor a token, nor a local token on loopback")
    launch: str = _opt(
        "local",
        "'local': this process is rank 0 and spawns ranks 1..tp-1 here; 'env': this process is the rank "
        "that torch's env:// rendezvous names (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; under a "
        "LeaderWorkerSet taken from LWS_WORKER_INDEX, LWS_GROUP_SIZE, LWS_LEADER_ADDRESS when unset), for "
        "ranks on several pods; only rank 0 serves gRPC",
        choices=("local", "env"),
    )
    device: str = _opt(
        "auto",
        "'auto' (CUDA with NCCL when present, else CPU with gloo), 'cpu' or 'cuda'",
        choices=("auto", "cpu", "cuda"),
    )
    dtype: str = _opt(
        "auto",
        "model dtype: 'auto' (float32 on CPU, bfloat16 on CUDA), 'float32', 'bfloat16' or 'float16'",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    cudnn_attention: bool = _opt(
        False,
        "on CUDA, let torch's attention use cuDNN's kernel (its first choice on Hopper GPUs): it plans a graph "
        "on the host for every new shape, and a decode step's keys grow every step, so it plans nearly every "
        "step (an H200: decode steps 1.3-1.8x as long with it, bench/step_profile.py); off, torch takes its "
        "flash or memory-efficient kernel",
    )
    decode_kv_multiple: int = _opt(
        1,
        "pad each decode step's keys (masked) to a multiple of this many, so that their shape repeats for "
        "attention kernels that plan per shape; 1 = no padding",
        min=1,
    )
    max_tensor_bytes: int = _opt(
        128 * 1024 * 1024,
        "largest tensor (and segment) accepted, bytes; the default takes a Qwen-VL image at its checkpoint's own "
        "pixel budget in bfloat16 or float16",
        min=1,
    )
    max_new_per_step: int = _opt(32, "new requests admitted into one step; the rest wait", min=1)
    max_running: int = _opt(64, "requests generating at once (rows of the batch)", min=1)
    max_queue: int = _opt(256, "accepted requests waiting for room; beyond this, OVERLOADED at once", min=1)
    max_prefill_tokens: int = _opt(
        4096,
        "tokens of one step's batched prefill (joining requests x their longest prompt; identical prompts, "
        "such as a request's n choices, count once); a longer "
        "prompt is prefilled in chunks of this many tokens, one a step, while the running requests go on "
        "decoding (with media too, while the encoder cache is on; with it off, a prompt with media longer than "
        "this is refused)",
        min=1,
    )
    kv_cache_bytes: int = _opt(
        4 * 1024**3, "KV-cache memory per rank; the token budget is derived from it and the model's shape", min=1
    )
    kv_budget_tokens: int = _opt(
        0,
        "KV-cache budget in tokens (rows x the longest reservation; a request reserves prompt + "
        "max_tokens); 0 = derived from --kv-cache-bytes",
        min=0,
    )
    default_max_tokens: int = _opt(64, "max_tokens of a request that leaves it 0", min=1)
    stream_interval: int = _opt(
        1,
        "tokens per streamed message of a running request: 1 sends each step's token as it comes; N sends "
        "every N tokens (the first token and the end at once), N times fewer messages for the tokenizer to "
        "relay, at the price of a burstier stream",
        min=1,
    )
    batch_window_s: float = _opt(
        0.002, "when idle, how long rank 0 waits after a first arrival for others to join the same step", min=0
    )
    heartbeat_s: float = _opt(
        1.0, "when idle, rank 0 still runs an empty step this often so no rank's collective times out", min=0.01
    )
    startup_timeout_s: float = _opt(300.0, "how long ranks wait for each other to start", min=1)
    collective_timeout_s: float = _opt(60.0, "a collective slower than this fails the group instead of hanging", min=1)
    tp_all_reduce: str = _opt(
        "shm",
        "how the model's tensor-parallel sums travel in a local CPU group (its ranks are forks of rank 0 on an "
        "x86 host): 'shm' (shared memory, ~100x less latency) or 'gloo'; elsewhere always the group's backend",
        choices=("shm", "gloo"),
    )
    step_timeout_s: float = _opt(
        300.0,
        "a step that makes no progress for this long fails the group like a dead rank (typed errors, "
        "NOT_SERVING, exit 1), at any TP size; allow for the longest prefill the limits admit",
        min=0.1,
    )
    cuda_ipc_backend: str = _opt(
        "mmsplit_server.handoff.cuda_ipc:cuda_backend",
        "module:factory of what opens CUDA IPC handles (tests substitute a fake device); the transport is "
        "offered when it reports GPUs and every rank is on this host (--launch local)",
    )
    cuda_ipc_max_pools: int = _opt(
        8,
        "CUDA IPC pools (one per tokenizer exporting to this group) each rank keeps open at most; the least "
        "recently used beyond it is closed, and a pool whose tokenizer is gone is closed within a second or so",
        min=1,
    )
    tensor_reader: str = _opt(
        "",
        "'module:factory' building each rank's tensor reader (scheduler_svc/reader.py); empty = shared memory/inline",
    )
    engine_hook: str = _opt(
        "",
        "a module whose functions each rank's engine calls at fixed points of a prefill (before_prefill, "
        "on_encoded), for fault injection in tests; empty = none",
    )
    encoder_cache_bytes: int = _opt(
        256 * 1024 * 1024,
        "bytes of encoder outputs each rank keeps for items seen before (keyed by the tensors' bytes, which "
        "each rank hashes itself), on the model's device; a hit skips the vision tower; 0 = off",
        min=0,
    )
    one_frame_image_rows: bool = _opt(
        True,
        "take an image's rows with its frame once from tokenizers, where the model's patches span several "
        "frames (Qwen: temporal_patch_size 2) and the image would be sent that many times, and repeat it "
        "here (on the model's device): half the bytes to hand over, hash, check and copy per image. false: "
        "tokenizers send every copy (as schedulers before this setting, which take only those)",
    )
    prefix_cache_bytes: int = _opt(
        1024**3,
        "bytes of keys and values each rank keeps (prompts once prefilled, finished requests' outputs), in "
        "blocks of 16 tokens, for later prompts that start the same (a conversation resent whole each turn, a "
        "shared system prompt): a hit skips the prefill of "
        "its blocks. Keyed by the tokens, each image's or video's tensors as this rank hashes them, and "
        "the request's cache_salt; on the model's device, beside --kv-cache-bytes; 0 = off",
        min=0,
    )
    heap_free_limit_bytes: int = _opt(
        256 << 20,
        "free memory each rank's heaps may keep (memory freed inside them, e.g. by large images' tensors, stays "
        "with the process); past it, a rank gives it back to the kernel when it has no request running, at most "
        "every 10 s; 0 = never given back",
        min=0,
    )
    wait_for_shared_prefix: int = _opt(
        64,
        "a request whose first N or more prompt tokens (its text before any image or video) are those of a "
        "request still being prefilled, and are not in the prefix cache, waits for that prefill and then "
        "takes them from the cache instead of computing them again alongside it (many requests arriving "
        "at once with one system prompt), where computing them has lately cost more than a decode step; "
        "others are admitted past it meanwhile. 0 = never wait; no effect with --prefix-cache-bytes 0",
        min=0,
    )
    tune_threads: bool = _opt(
        True,
        "on a CPU device, run each step on all of a rank's threads or on one fewer, whichever has been faster "
        "lately for steps of its kind: decode steps by their rows, prefills by their prompt tokens, per token "
        "(the other re-measured now and then; a prefill size runs on every thread its first 3 times): on a host "
        "whose cores the tokenizer shares, leaving it one can be faster",
    )
    lm_head_layout: str = _opt(
        "auto",
        "how each rank stores the LM head's weight (its rows of it under TP): 'stored' as the checkpoint has "
        "it, 'columns' column after column, 'auto' whichever multiplied faster when measured at start-up "
        "(on a CPU device; elsewhere as stored). On a CPU, MKL multiplies a few rows by the column-major "
        "weight up to 2x faster; the values are the same (laying it out copies it once, at start-up)",
        choices=("auto", "stored", "columns"),  # head_layout.LAYOUTS (this module does not import torch)
    )
    scheduling_policy: str = _opt(
        "fcfs",
        "the order queued requests are admitted in: 'fcfs', first come first served (a request's priority must "
        "be 0); 'priority', lower GenerateRequest.priority first, then first come first served (vLLM's priority "
        "policy; running requests are never preempted). Under 'priority' any client may jump the queue: set it "
        "where the clients that reach this scheduler are trusted to",
        choices=("fcfs", "priority"),
    )
    lean_decode: bool = _opt(
        True,
        "decode steps of a Llama, Qwen2-VL or Qwen3-VL text model (the LLaVA, "
        "Qwen2-VL, Qwen2.5-VL and Qwen3-VL families; not Qwen3-VL-MoE) make the model's "
        "operations without transformers' module calls around them: the same operations on the same weights "
        "in the same order, checked bit for bit against the model's own forward at start-up (where they "
        "differ, and for other text models, the model's own forward runs; under TP the TP plan's projections "
        "sum inside their own forwards, which it calls). On a CPU a one-row "
        "decode step of an 8-layer 512-wide model takes 0.92x as long without them",
    )
    moe_experts: str = _opt(
        "split",
        "where a mixture-of-experts model's experts sit on a TP group (Qwen3-VL-MoE): 'split', each rank keeps "
        "1/n of every expert and computes 1/n of its work (one more sum per MoE layer), or 'whole', every rank "
        "keeps and runs every expert (on a CPU host the ranks then share the checkpoint's pages: less memory, "
        "more time; on GPUs n times the experts' memory)",
        choices=("split", "whole"),
    )
    max_message_bytes: int = _opt(256 * 1024 * 1024, "largest gRPC message, bytes", min=1024)
    stats_interval_s: float = _opt(10.0, "how often the step loop logs its statistics", min=0.01)

    def problems(self) -> list[str]:
        problems = super().problems()
        problems.extend(security_problems(self))
        if self.default_max_tokens > self.max_tokens_limit:
            problems.append(
                f"--default-max-tokens ({self.default_max_tokens}) is over --max-tokens-limit ({self.max_tokens_limit})"
            )
        return problems


def security_problems(s: SchedulerSettings) -> list[str]:
    """The scheduler's port faces only our tokenizers (DESIGN.md §7): on
    loopback it may be open; anywhere else only a caller with a client
    certificate or the token may name segments to it."""
    problems = []
    if not is_loopback(s.host) and not (s.tls_client_ca or s.auth_token_file) and not s.insecure:
        problems.append(
            f"--host {s.host} is not a loopback address: the scheduler's port must then require mutual TLS "
            "(--tls-cert, --tls-key, --tls-client-ca) or a token (--auth-token-file); to serve it open "
            "anyway, say --insecure"
        )
    return problems
