"""Settings of the tokenizer service. Built once by the CLI (flags with
MMSPLIT_* environment fallbacks, see `mmsplit_cli.config`) and passed down;
nothing else reads the environment. Each field's `help` is its documentation;
ranges and choices are checked when the object is made (`mmsplit_server.settings`)."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path

from mmsplit_server.settings import ServiceSettings
from mmsplit_server.settings import opt as _opt


@dataclass(frozen=True, kw_only=True)
class TokenizerSettings(ServiceSettings):
    model_dir: Path = field(
        metadata={"help": "local checkpoint directory (its processor is loaded)", "flag": "--model"}
    )
    scheduler: str = _opt(
        "127.0.0.1:50051",
        "scheduler address HOST:PORT; several scheduler groups: HOST:PORT,HOST:PORT,... or dns:///NAME:PORT "
        "(every address NAME resolves to, e.g. a headless Service); each request goes to the ready one with "
        "the fewest of this tokenizer's requests",
    )
    scheduler_stream: bool = _opt(
        True,
        "send requests to a scheduler that serves it over one GenerateStream call, which carries a step's "
        "tokens for all of them in one message (false: a Generate call per request, a message per request "
        "and step); a request too large for one message goes by Generate either way",
    )
    scheduler_tls_ca: str = _opt("", "PEM CA certificates to verify the scheduler's TLS certificate: use TLS")
    scheduler_tls_cert: str = _opt("", "PEM client certificate presented to the scheduler (mutual TLS)")
    scheduler_tls_key: str = _opt("", "PEM private key of --scheduler-tls-cert")
    scheduler_tls_server_name: str = _opt("", "name the scheduler's certificate carries, when not its address")
    scheduler_auth_token_file: str = _opt(
        "", "file holding the token the scheduler requires (its first line; read again when it changes)"
    )
    port: int = _opt(
        50052, "port to serve gRPC on (mmsplit generate's --server default); 0 picks a free one (logged)", min=0
    )
    tls_cert: str = _opt("", "PEM certificate (chain) of this server: serve TLS to clients (with --tls-key)")
    tls_client_ca: str = _opt("", "PEM CA certificates: require clients to present a certificate they signed")
    http_port: int = _opt(
        8000,
        "serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, /health) on this "
        "port of --host; 0 = off",
        min=0,
    )
    served_model_name: str = _opt(
        "", "the model's name in the HTTP API (requests naming another get 404); empty = the model directory's name"
    )
    api_key_file: str = _opt(
        "",
        "file of API keys, one per line, every /v1 HTTP request must bear one of (Authorization: Bearer KEY); read "
        "again when it changes (keys rotate without a restart); empty = none",
    )
    http_max_body_bytes: int = _opt(
        0,
        "largest HTTP request body, bytes (413 beyond it); 0 = what the media limits allow as base64 data: URLs "
        "(images x --max-image-bytes and videos x --max-video-bytes, times 4/3, plus the prompt and some room)",
        min=0,
    )
    max_body_bytes_in_flight: int = _opt(
        2 * 1024 * 1024 * 1024,
        "HTTP request bodies held at once, bytes: each request's from before its body is read until its answer "
        "starts (its media are prepared and let go by then; until it ends where the answer keeps its input, a "
        "stored Responses answer, or the request has several prompts); a request that would pass it is "
        "OVERLOADED (429, Retry-After) unread, one always let through when none is held; 0 = no limit",
        min=0,
    )
    responses_store_bytes: int = _opt(
        64 * 1024 * 1024,
        "memory for the Responses API's stored responses (store: true, the default; previous_response_id, GET and "
        "DELETE /v1/responses/{id}); when full, the least recently used of the API key holding the most go first; "
        "kept per tokenizer, lost on restart; "
        "0 = store none",
        min=0,
    )
    http_request_timeout_s: float = _opt(
        75.0,
        "seconds an HTTP client has to send a request's headers (from connecting, or from its last answer on a "
        "kept-alive connection, which is then closed when idle) and then as long again for its body; a slower "
        "client is cut off instead of holding a connection open (slowloris)",
        min=1.0,
    )
    http_keepalive_s: float = _opt(
        15.0, "a streamed HTTP response says ': keep-alive' this often while nothing else comes (proxies)", min=0.01
    )
    shm_slab_bytes: int = _opt(
        128 * 1024 * 1024,
        "size of the pre-faulted shared-memory slab pixel tensors are written into, created on the first "
        "shared-memory request; tensors over a quarter of it get a segment of their own; 0 = a segment per tensor",
        min=0,
    )
    shm_slab_wait_s: float = _opt(
        1.0, "how long a tensor waits for room in a full slab; beyond this, OVERLOADED (retriable)", min=0
    )
    cuda_ipc_pool_bytes: int = _opt(
        256 * 1024 * 1024,
        "size of the GPU staging pool pixel tensors are handed over from by CUDA IPC, when the device backend "
        "reports a GPU (used with schedulers that can open handles of it); 0 = no CUDA IPC",
        min=0,
    )
    cpu_workers: int = _opt(2, "processes decoding and preprocessing images", min=1)
    io_threads: int = _opt(4, "threads reading image files (under --allowed-media-dir)", min=1)
    fetch_connections: int = _opt(100, "connections open to origins at once, all requests together", min=1)
    fetch_resolver: str = _opt(
        "", "'module:factory' making the DNS resolver of fetches (an aiohttp resolver); empty = the system's"
    )
    preprocess_timeout_s: float = _opt(
        10.0, "budget of one image's decode + preprocessing in a worker (fetching and waiting excluded)", min=0.01
    )
    preprocess_cache_bytes: int = _opt(
        256 * 1024 * 1024,
        "preprocessed items kept for media seen again (keyed by their bytes, the model and these settings); 0 = off",
        min=0,
    )
    preprocess_queue_timeout_s: float = _opt(
        30.0, "how long an image may wait for a free worker; beyond this, OVERLOADED (retriable)", min=0
    )
    fetch_timeout_s: float = _opt(
        5.0, "deadline of one fetch attempt: resolving, connecting, redirects and the whole body", min=0.01
    )
    fetch_retries: int = _opt(2, "extra attempts after a timeout, connection error or 5xx", min=0)
    fetch_backoff_s: float = _opt(0.2, "first retry delay; doubles per attempt, with jitter", min=0)
    max_image_bytes: int = _opt(20 * 1024 * 1024, "largest encoded image, bytes", min=1)
    max_image_pixels: int = _opt(40_000_000, "largest decoded image, width x height (checked before decoding)", min=1)
    max_aspect_ratio: float = _opt(
        50.0, "longest side / shortest side accepted (a 1x20000 strip would resize into gigabytes)", min=1
    )
    max_videos_per_request: int = _opt(1, "videos one request may carry (models that take video)", min=0)
    max_video_bytes: int = _opt(50 * 1024 * 1024, "largest encoded video, bytes", min=1)
    max_video_frame_pixels: int = _opt(
        3840 * 2160,
        "largest video frame, width x height (checked from the headers, and by the decoder for every frame)",
        min=1,
    )
    max_video_duration_s: float = _opt(600.0, "longest video, seconds (declared and as demuxed)", min=0.01)
    max_video_file_frames: int = _opt(
        36_000, "most frames a video file may hold (counted before decoding; sampling keeps far fewer)", min=1
    )
    video_fps: float = _opt(
        0.0, "frames sampled per second of video; 0 = the model's (its video processor's fps, else 2)", min=0
    )
    video_max_frames: int = _opt(
        32, "most frames sampled from one video (the model's own max_frames, when lower, wins)", min=1
    )
    video_preprocess_timeout_s: float = _opt(
        60.0, "budget of one video's decode + preprocessing in a worker (fetching and waiting excluded)", min=0.01
    )
    max_prompt_chars: int = _opt(100_000, "longest prompt, characters", min=1)
    chat_template: str = _opt(
        "auto",
        "auto = the chat template the model ships, when it ships one (each prompt becomes one user turn, with the "
        "generation prompt); none = prompts as written; else a path to a Jinja template file",
    )
    trust_request_chat_template: bool = _opt(
        False,
        "render a conversation with the chat template its request gives (GenerateRequest.chat_template, the HTTP "
        "API's chat_template) instead of refusing it: a template is code the tokenizer runs (sandboxed Jinja, "
        "but a costly one holds the tokenizer while it renders), so only where the clients are trusted to",
    )
    tool_call_parser: str = _opt(
        "none",
        'how the HTTP API finds the tool calls a model writes itself, for tool_choice "auto" (the default '
        'when a request gives tools): \'hermes\', <tool_call>{"name": ..., "arguments": {...}}</tool_call> '
        "after any text, as Qwen2.5 and many others write them; 'llama3_json', the whole answer "
        '{"name": ..., "parameters": {...}} (several joined by ;), as Llama 3.1 writes them; \'pythonic\', the '
        'whole answer [f(a=1), g(b="x")], as Llama 3.2 and 4 write them (give the model a chat template that '
        "renders tools: --chat-template); 'qwen3_coder', <tool_call><function=f><parameter=a>1</parameter>"
        "</function></tool_call> after any text, as Qwen3-Coder writes them (each value typed by the tool's "
        'schema); \'none\': "auto" is refused ("required" and a named function need no parser)',
        choices=("none", "hermes", "llama3_json", "pythonic", "qwen3_coder"),
    )
    reasoning_parser: str = _opt(
        "none",
        "how the HTTP API tells a reasoning model's thinking from its answer: 'qwen3' and 'deepseek_r1' (the same "
        "form: <think>...</think>, the model starting inside it when the chat template's generation prompt ends "
        "with <think>) answer the thinking as chat completions' reasoning (and reasoning_content) and the "
        "Responses API's reasoning item, the rest as the content; 'none': the output is all content",
        choices=("none", "qwen3", "deepseek_r1"),
    )
    max_tokens_limit: int = _opt(
        4096, "largest sampling.max_tokens accepted (the scheduler applies its own limit as well)", min=1
    )
    heap_free_limit_bytes: int = _opt(
        256 << 20,
        "free memory this process's heaps may keep (big bodies and data: URLs leave it behind); past it, it is "
        "given back to the kernel, at most every 10 s; 0 = never given back",
        min=0,
    )
    allowed_media_dir: str = _opt("", "images given as file paths must lie under this directory; empty = none allowed")
    allow_private_fetch: bool = _opt(False, "allow fetching from loopback/private addresses (tests, demos)")
    allowed_domains: str = _opt(
        "", "comma-separated domains images may be fetched from (subdomains included); empty = any public host"
    )
    private_fetch_exempt: str = _opt(
        "", "comma-separated HOST:PORT destinations exempt from the private-address guard (a sidecar, a test origin)"
    )
    max_inflight: int = _opt(256, "requests in progress; beyond this, OVERLOADED at once", min=1)
    max_inflight_per_client: int = _opt(
        0,
        "requests in progress from one client (its API key over HTTP when --api-key-file is set, else its "
        "address); beyond this, that client's next is OVERLOADED at once while others are served; 0 = no limit",
        min=0,
    )
    max_connections_per_client: int = _opt(
        0,
        "open connections to the HTTP API from one address (those of --forwarded-allow-ips proxies never refused); "
        "past it, that address's new connection is closed at once, unread; 0 = no limit",
        min=0,
    )
    forwarded_allow_ips: str = _opt(
        "",
        "comma-separated addresses or networks (CIDR) of proxies in front of the HTTP API whose X-Forwarded-For "
        "names the client (for --max-inflight-per-client without API keys); empty = none is trusted",
    )
    cors_allow_origins: str = _opt(
        "",
        "comma-separated origins (scheme://host[:port]) whose web pages may call the HTTP API from a browser "
        "(CORS), or * for any page; empty = none (browsers then refuse cross-origin calls; clients that are not "
        "browsers are not affected). With * and no --api-key-file, any page a user of this host opens can use "
        "the model",
    )
    scheduler_wait_s: float = _opt(120.0, "how long startup waits for the scheduler before serving NOT_SERVING", min=0)
    unavailable_retry_after_ms: int = _opt(
        1000,
        "while the scheduler is unreachable, clients whose gRPC retry policy retries UNAVAILABLE are told to "
        "wait this long before the next attempt (server pushback); 0 leaves the wait to their own backoff",
        min=0,
    )
    keepalive_s: float = _opt(
        20.0,
        "seconds between HTTP/2 keepalive pings on every connection this service holds (its clients', and its "
        "schedulers'): a peer that stops answering (its node gone, a network partition) is found within this plus "
        "--keepalive-timeout-s, and its calls end (their requests aborted, their memory released); at least 1; 0 = off",
        min=0,
    )
    max_connection_age_s: float = _opt(
        0.0,
        "seconds after which a client's connection is asked to go (HTTP/2 GOAWAY; its running calls finish on it, "
        "its next ones open a new one): behind a Kubernetes Service, clients then spread over tokenizers added by "
        "scaling instead of keeping the ones they first reached; 0 = never",
        min=0,
    )
    max_message_bytes: int = _opt(
        0,
        "largest request message, bytes; 0 = what the media limits allow (images x --max-image-bytes, the "
        "prompt, some room), so a request within every limit always fits",
        min=0,
    )
    worker_memory_bytes: int = _opt(
        0,
        "address space each CPU worker may add to what it maps once started (RLIMIT_AS): an item that needs more "
        "fails MEDIA_TOO_LARGE and the worker serves on, where it would otherwise grow until the OOM killer takes "
        "the pod; 0 = derived from the media limits: 1 GiB + 8 bytes x the larger of --max-image-pixels and "
        "--max-video-frame-pixels x --video-max-frames",
        min=0,
    )
    worker_hook: str = _opt(
        "", "module imported by each CPU worker: on_worker_start(), on_decoded(image) (tests inject faults with it)"
    )

    def served_ports(self) -> list[tuple[str, str, int]]:
        return [*super().served_ports(), ("--http-port", self.host, self.http_port)]

    def problems(self) -> list[str]:
        problems = super().problems()
        if bool(self.scheduler_tls_cert) != bool(self.scheduler_tls_key):
            problems.append("--scheduler-tls-cert and --scheduler-tls-key go together")
        if self.scheduler_tls_cert and not self.scheduler_tls_ca:
            problems.append("--scheduler-tls-cert needs --scheduler-tls-ca (a client certificate goes over TLS)")
        try:
            _ = self.trusted_proxies
        except ValueError as exc:
            problems.append(f"--forwarded-allow-ips: {exc}")
        problems.extend(scheduler_problems(self.scheduler))
        for origin in self.cors_origins:
            if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
                problems.append(f"--cors-allow-origins: {origin!r} is not an origin (scheme://host[:port], or *)")
        return problems

    @property
    def cors_origins(self) -> tuple[str, ...]:
        """`cors_allow_origins` as a tuple of origins ("*": any)."""
        return tuple(part.strip().rstrip("/") for part in self.cors_allow_origins.split(",") if part.strip())

    @property
    def trusted_proxies(self) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
        """`forwarded_allow_ips` as networks (an address is a network of one); ValueError names a bad one."""
        return tuple(
            ipaddress.ip_network(part.strip(), strict=False)
            for part in self.forwarded_allow_ips.split(",")
            if part.strip()
        )

    @property
    def http_body_limit(self) -> int:
        """The largest HTTP request body this server reads (`http_max_body_bytes`, or derived)."""
        if self.http_max_body_bytes:
            return self.http_max_body_bytes
        media = self.max_images_per_request * self.max_image_bytes + self.max_videos_per_request * self.max_video_bytes
        return media * 4 // 3 + 4 * self.max_prompt_chars + 1024 * 1024

    @property
    def worker_memory_limit(self) -> int:
        """The address space a CPU worker may add (`worker_memory_bytes`, or derived)."""
        if self.worker_memory_bytes:
            return self.worker_memory_bytes
        pixels = max(self.max_image_pixels, self.max_video_frame_pixels * self.video_max_frames)
        return (1 << 30) + 8 * pixels

    @property
    def message_limit(self) -> int:
        """The largest request message this server reads (`max_message_bytes`, or derived)."""
        if self.max_message_bytes:
            return self.max_message_bytes
        prompt = 4 * self.max_prompt_chars  # UTF-8
        images = self.max_images_per_request * (self.max_image_bytes + 1024)
        videos = self.max_videos_per_request * (self.max_video_bytes + 1024)
        return images + videos + prompt + 1024 * 1024


def scheduler_problems(setting: str) -> list[str]:
    """`--scheduler` is HOST:PORT[,HOST:PORT...] or dns:///NAME:PORT: a
    target without its port, or with a URL's scheme, would be dialled for
    ever and never answer."""
    targets = [setting.removeprefix("dns:///")] if setting.startswith("dns:///") else setting.split(",")
    problems = []
    for target in (t.strip() for t in targets if t.strip()):  # an empty part is skipped, as the links skip it
        host, _, port = target.rpartition(":")
        if "://" in target or not host or not port.isdigit() or not 0 < int(port) < 65536:
            problems.append(
                f"--scheduler {target!r} is not HOST:PORT (no scheme; [v6 address]:PORT; several "
                "comma-separated, or dns:///NAME:PORT)"
            )
    return problems
