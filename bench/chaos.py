"""Chaos soak: many faults at once, for a set time, under mixed load.

One tokenizer in front of two scheduler groups (TP=2 each, or `--tp 1`:
one rank each, whose decode steps then run the lean body,
`scheduler_svc/lean_decode.py`; the tiny Qwen2-VL, which takes images and
videos),
and clients that keep C requests in flight for the whole run (its minutes,
and at least until every kind below has been sent: the kinds are dealt
from shared shuffled decks, each kind as often as its weight): over gRPC
through `mmsplit.client` (its retries on), and over the OpenAI-compatible
HTTP API through the official `openai` SDK (its retries on); images (most
seen before, some never; over HTTP some at a smaller pixel budget of their
own, `mm_processor_kwargs`, half asking for the token ids, `return_token_ids`),
text, videos, corrupt images, clients that cancel
mid-request, prompts scored (prompt log probabilities), completions echoing
their token-id prompts with log probabilities, beam searches over HTTP
(width 2: a scheduler request per beam and step), and stored Responses API
answers continued (`previous_response_id`) and deleted. Meanwhile
a fault injector, at random times drawn from a seed, SIGKILLs a CPU worker,
the tokenizer's forkserver, rank 1 of a group (TP=2), or a whole group;
freezes a rank (rank 1, or at TP=1 the group's one; SIGSTOP, then SIGCONT
a moment later); with `--shm-size`, fills
/dev/shm to within a few MiB of its limit for a few seconds; and restarts
every group it took down on the same port. `--shm-size SIZE` runs the whole
soak (this script, the tokenizer and both groups, which then still share
memory) in a mount namespace of its own with a tmpfs of SIZE on /dev/shm,
never the host's (root only; the fault is refused unless /dev/shm is
another file system than it was before). `--caches off` turns the tokenizer's preprocessing cache and the
schedulers' encoder and prefix caches off, so that what grows is not a
cache filling up: each process's resident memory must then end within 10 %
of its start plus the free heap a service keeps for its next large buffer
(`mmsplit_server.mallocheap`, 128 MiB: the warm-up may not have touched it
all); with the caches on it grows by up to their bounds.

Every request must end with an answer: its tokens, or a typed error that is
retriable or its own bad input. Printed: requests by outcome (ok, each
ErrorCode, cancelled by the client, untyped, lost: no answer within the
client's deadline), retries made by the clients (HTTP: the SDK's; gRPC:
the calls the tokenizer saw carrying `grpc-previous-rpc-attempts`, which
gRPC adds to a retry, from its metrics), p50 and p99 of the successes' latency, the faults
injected, what was left in /dev/shm and in the slab after the load, and the
tokenizer's descriptors and resident memory at the start and the end. Exit
status 1 when something was lost, untyped or left behind.

    python bench/chaos.py [--minutes 10] [--concurrency 12] [--seed 1] [--fault-every-s 6] [--tp 2]
                          [--tp-all-reduce gloo]
                          [--shm-size 1g] [--caches on|off] [--scheduler-args '--max-prefill-tokens 32']
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import shlex
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpc
import psutil
from harness import percentile, scratch_dir, table

from mmsplit.client import AsyncClient, RequestFailed
from mmsplit.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mmsplit_cli import samples
from mmsplit_cli.launch import (
    SCHEDULER_SERVICE,
    START_ATTEMPTS,
    TOKENIZER_SERVICE,
    ServiceProcess,
    StartFailed,
    scheduler_args,
    tokenizer_args,
)
from mmsplit_server import families, mallocheap
from mmsplit_server.handoff import ranges
from mmsplit_server.serving import free_port

IMAGES = [samples.encode(samples.gradient(320, 240, seed=i), "JPEG") for i in range(12)]
VIDEO = samples.video(frames=6, seed=3)
CORRUPT = samples.good_png(seed=1)[:300]
# A client's own bad input, and what a fault may cause (retriable, typed).
OWN_FAULT = {"MEDIA_DECODE_FAILED"}
DEADLINE_S = 90.0  # a request with no answer by then is lost
# The served model's name (its directory's), for the HTTP requests.
MODEL_NAME = [""]
# Pixel budgets the HTTP image requests ask for in turn (mm_processor_kwargs:
# none, or within the model's own); only none for a model without one.
BUDGETS: list[dict[str, int]] = [{}]
FAULTS = ("worker", "forkserver", "rank1", "group", "freeze")
# What the clients send, and how often: "scored" asks for prompt log
# probabilities over gRPC, "echo" is a completion echoing its token-id prompt
# with log probabilities, "conversation" a stored Responses API answer that
# a second request continues (previous_response_id) and a third deletes.
KINDS = ["image", "text", "http", "video", "corrupt", "cancel", "scored", "echo", "conversation", "beams"]
WEIGHTS = [5, 2, 3, 1, 1, 2, 1, 1, 1, 1]
SHM_FAULT = "shm-full"  # drawn only with a /dev/shm of the run's own (--shm-size)
SHM_MARGIN = 4 << 20  # what the fault leaves free
# In the environment of the run re-executed in a mount namespace of its
# own: the device number of the host's /dev/shm.
PRIVATE_SHM_ENV = "MMSPLIT_CHAOS_HOST_SHM_DEV"
NO_CACHES = {"tokenizer": ["--preprocess-cache-bytes", "0"],
             "scheduler": ["--encoder-cache-bytes", "0", "--prefix-cache-bytes", "0"]}  # fmt: skip


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    retries: int = 0
    grpc_retries: int = 0  # calls the tokenizer saw marked as gRPC's retries (its metrics)
    faults: Counter[str] = field(default_factory=Counter)
    kinds: Counter[str] = field(default_factory=Counter)  # requests by kind: "image", "image not ok", ...
    bad: list[str] = field(default_factory=list)  # what fails the run: lost, untyped, not retriable, wrong

    def wrong(self, what: str) -> str:
        """An answer that came but is not what was asked: it fails the run."""
        self.bad.append(what)
        return "wrong answer"


class Deck:
    """The kinds the clients send, dealt from shuffled decks shared by every
    client: each deck holds every kind as often as its weight, so every
    whole deck sends each kind however few requests a slow host makes
    (independent draws can leave a kind of weight 1 out of a short run: of
    30 requests, ~16 % of the time)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.cards = [kind for kind, weight in zip(KINDS, WEIGHTS, strict=True) for _ in range(weight)]
        self.left: list[str] = []
        self.decks = 0  # decks begun

    def deal(self) -> str:
        if not self.left:
            self.left = self.rng.sample(self.cards, len(self.cards))
            self.decks += 1
        return self.left.pop()

    def whole(self) -> bool:
        """Whether a whole deck has been dealt: every kind at least once."""
        return self.decks > 1 or (self.decks == 1 and not self.left)


class Group:
    """One scheduler group on a fixed port, restarted when it dies."""

    def __init__(self, name: str, model: Path, logs: Path, prefix: str, extra: list[str], tp: int = 2) -> None:
        self.name, self.model, self.logs, self.prefix, self.extra, self.tp = name, model, logs, prefix, extra, tp
        self.port = free_port()
        self.starts = 0
        self.proc = self._start()

    def _start(self) -> ServiceProcess:
        self.starts += 1
        extra = ["--port", str(self.port), "--shm-prefix", self.prefix, *self.extra]
        args = scheduler_args(self.model, tp=self.tp, extra=extra)
        return ServiceProcess(self.name, args, self.logs / f"{self.name}-{self.starts}.log")

    def ranks(self) -> list[psutil.Process]:
        try:
            return [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def serve_first(self, timeout: float) -> None:
        """SERVING after its first start, started again on another port
        while the one drawn was taken before the group bound it."""
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                self.proc.wait_serving(SCHEDULER_SERVICE, timeout)
                return
            except StartFailed:
                if not self.proc.port_taken() or attempt == START_ATTEMPTS:
                    raise
                self.proc.stop()
                self.proc.log_path.rename(self.proc.log_path.with_suffix(f".attempt{attempt}.log"))
                self.port, self.starts = free_port(), self.starts - 1  # the failed start is not counted
                self.proc = self._start()

    def restart_if_dead(self) -> bool:
        if self.proc.proc.poll() is None:
            return False
        self.proc.stop()
        self.proc = self._start()
        return True

    def serve_again(self, timeout: float) -> None:
        """SERVING, restarted as often as it dies meanwhile (a group whose
        rank 1 was just killed is still on its way out when the load ends)."""
        deadline = time.monotonic() + timeout
        while True:
            self.restart_if_dead()
            try:
                self.proc.wait_serving(SCHEDULER_SERVICE, max(1.0, deadline - time.monotonic()))
                return
            except RuntimeError:
                if time.monotonic() >= deadline:
                    raise

    def stop(self) -> None:
        self.proc.stop()

    def footprints(self) -> list[tuple[int, int]]:
        """(descriptors, resident bytes) of each rank, rank 0 first."""
        out = []
        for rank in self.ranks():
            with contextlib.suppress(psutil.Error):
                out.append(footprint(rank.pid))
        return out


async def one(
    rng: random.Random, deck: Deck, address: str, tally: Tally, stop_at: float, openai_client: object
) -> None:
    """Requests one after another until the run ends: its time is up and a
    whole deck of kinds has been dealt."""
    async with AsyncClient(address, retries=3) as client:
        while time.monotonic() < stop_at or not deck.whole():
            kind = deck.deal()
            started = time.monotonic()
            outcome = await asyncio.wait_for(_request(kind, rng, client, openai_client, tally), DEADLINE_S + 5)
            if outcome == "ok":
                tally.latencies.append(time.monotonic() - started)
            tally.outcomes[outcome] += 1
            tally.kinds[kind if outcome == "ok" else f"{kind} not ok"] += 1


async def _request(kind: str, rng: random.Random, client: AsyncClient, api: object, tally: Tally) -> str:
    # Mostly images seen before (the preprocessing cache's), some never seen (the CPU workers').
    image = rng.choice(IMAGES) if rng.random() < 0.7 else fresh_image(rng)
    try:
        if kind == "http":
            import openai

            url = "data:image/jpeg;base64," + __import__("base64").b64encode(image).decode()
            content = [{"type": "text", "text": "Describe it."}, {"type": "image_url", "image_url": {"url": url}}]
            budget, ids = rng.choice(BUDGETS), rng.random() < 0.5
            extra: dict[str, object] = {"mm_processor_kwargs": budget} if budget else {}
            if ids:
                extra["return_token_ids"] = True
            raw = await api.chat.completions.with_raw_response.create(  # type: ignore[attr-defined]
                model=MODEL_NAME[0], messages=[{"role": "user", "content": content}], max_tokens=6, timeout=DEADLINE_S,
                extra_body=extra or None,
            )  # fmt: skip
            tally.retries += int(raw.retries_taken)
            answer = raw.parse()
            whole = answer.model_dump()
            if ids and not (whole.get("prompt_token_ids") and whole["choices"][0].get("token_ids")):
                return tally.wrong("http: return_token_ids answered without the ids")
            return "ok" if answer.choices else "http: no choices"
        if kind in ("echo", "conversation", "beams"):
            return await _stateful_http(kind, image, api, tally)
        if kind == "cancel":
            gen = client.generate("Look.", images=[image], max_tokens=32, timeout=DEADLINE_S)
            task = asyncio.ensure_future(_drain(gen))
            await asyncio.sleep(rng.uniform(0.0, 0.5))
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                return "cancelled by the client"
            return "ok"
        if kind == "text":
            await client.complete("Tell me something.", max_tokens=rng.randint(1, 12), timeout=DEADLINE_S)
        elif kind == "video":
            await client.complete("Watch.", videos=[VIDEO], max_tokens=4, timeout=DEADLINE_S)
        elif kind == "scored":
            top = rng.randint(0, 3)
            done = await client.complete("Look.", images=[image], max_tokens=2, prompt_logprobs=top, timeout=DEADLINE_S)
            scores = done.prompt
            if scores is None or len(scores.logprobs) != done.prompt_tokens or scores.logprobs[0] is not None:
                return tally.wrong(f"scored: prompt log probabilities missing or short: {scores}")
            if any(len(t) < top for t in scores.top[1:]):
                return tally.wrong(f"scored: fewer than {top} top tokens")
        elif kind == "corrupt":
            await client.complete("Look.", images=[CORRUPT], max_tokens=4, timeout=DEADLINE_S)
            tally.bad.append("a corrupt image succeeded")
        else:
            await client.complete("Look.", images=[image], max_tokens=rng.randint(1, 12), timeout=DEADLINE_S)
        return "ok"
    except RequestFailed as exc:
        if exc.reason == "DEADLINE_EXCEEDED" or exc.grpc_code == "DEADLINE_EXCEEDED":
            tally.bad.append(f"lost: {kind} had no answer in {DEADLINE_S:.0f}s")
            return "lost"
        if not exc.reason or exc.reason == "UNKNOWN":
            tally.bad.append(f"untyped: {kind}: {exc}")
            return "untyped"
        if exc.reason == "MEDIA_UNSUPPORTED" and kind == "video":
            return "video: the model takes none"  # the client's ask, typed (a model without video)
        if not exc.retriable and exc.reason not in OWN_FAULT:
            tally.bad.append(f"not retriable: {kind}: {exc.reason}: {exc}")
        if exc.reason in OWN_FAULT and kind != "corrupt":
            tally.bad.append(f"{kind} failed as bad input: {exc}")
        return exc.reason
    except Exception as exc:  # the SDK's errors: typed when the server answered with its JSON error body
        import openai

        if isinstance(exc, openai.APIStatusError):
            code = (exc.body or {}).get("code") if isinstance(exc.body, dict) else None
            if not code:
                tally.bad.append(f"untyped HTTP {exc.status_code}: {exc}")
                return "untyped"
            if exc.response.headers.get("x-should-retry") != "true":
                tally.bad.append(f"not retriable over HTTP: {code}")
            return str(code)
        if isinstance(exc, openai.APITimeoutError):
            tally.bad.append("lost: an HTTP request had no answer")
            return "lost"
        tally.bad.append(f"untyped: {kind}: {type(exc).__name__}: {exc}")
        return "untyped"


async def _stateful_http(kind: str, image: bytes, api: object, tally: Tally) -> str:
    """An "echo", "conversation" or "beams" request over the SDK (its errors
    go to the caller's handling): "ok", or what was wrong with the answer."""
    url = "data:image/jpeg;base64," + __import__("base64").b64encode(image).decode()
    if kind == "beams":
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]
        raw = await api.chat.completions.with_raw_response.create(  # type: ignore[attr-defined]
            model=MODEL_NAME[0], messages=[{"role": "user", "content": content}], max_tokens=4, n=2,
            extra_body={"use_beam_search": True}, timeout=DEADLINE_S,
        )  # fmt: skip
        tally.retries += int(raw.retries_taken)
        choices = raw.parse().choices
        if [c.index for c in choices] != [0, 1]:
            return tally.wrong(f"beams: {len(choices)} choices, not 2")
        return "ok"
    if kind == "echo":
        prompt = list(range(100, 110))  # ordinary tokens of the vocabulary, no placeholder
        raw = await api.completions.with_raw_response.create(  # type: ignore[attr-defined]
            model=MODEL_NAME[0], prompt=prompt, max_tokens=3, echo=True, logprobs=1, timeout=DEADLINE_S
        )
        tally.retries += int(raw.retries_taken)
        lp = raw.parse().choices[0].logprobs
        if lp is None or len(lp.token_logprobs) < len(prompt) or lp.token_logprobs[0] is not None:
            return tally.wrong(f"echo: the prompt's log probabilities missing: {lp}")
        return "ok"
    content = [{"type": "input_image", "image_url": url}, {"type": "input_text", "text": "What is it?"}]
    first = await api.responses.with_raw_response.create(  # type: ignore[attr-defined]
        model=MODEL_NAME[0],
        input=[{"role": "user", "content": content}],
        max_output_tokens=4,
        timeout=DEADLINE_S,
    )
    tally.retries += int(first.retries_taken)
    answer = first.parse()
    then = await api.responses.with_raw_response.create(  # type: ignore[attr-defined]
        model=MODEL_NAME[0], previous_response_id=answer.id, input="And then?", max_output_tokens=4, timeout=DEADLINE_S
    )
    tally.retries += int(then.retries_taken)
    items = await api.responses.input_items.list(then.parse().id)  # type: ignore[attr-defined]
    if len(items.data) != 3:  # the first input, the first answer, the new input
        return tally.wrong(f"conversation: {len(items.data)} input items, not 3")
    await api.responses.delete(answer.id)  # type: ignore[attr-defined]
    await api.responses.delete(then.parse().id)  # type: ignore[attr-defined]
    return "ok"


def fresh_image(rng: random.Random) -> bytes:
    return samples.encode(samples.gradient(160, 120, seed=rng.randrange(1 << 30)), "JPEG")


async def _drain(gen: object) -> None:
    async for _ in gen:  # type: ignore[attr-defined]
        pass


def tokenizer_tree(pid: int, prefix: str) -> tuple[psutil.Process | None, list[psutil.Process]]:
    """(the tokenizer's forkserver, its CPU workers): among its descendants,
    among processes with its command line, and among processes that call
    themselves CPU workers and map the tokenizer's slab. A worker whose
    forkserver was killed lives on (and goes on serving), reparented, with
    its forkserver's command line: the tokenizer's own, or once that
    forkserver is gone multiprocessing's (`python -c ...`), which only its
    slab mapping (`/dev/shm/<prefix>-<tokenizer pid>-...`) ties to this
    tokenizer."""
    try:
        tokenizer = psutil.Process(pid)
        command = tokenizer.cmdline()
        found = {p.pid: p for p in tokenizer.children(recursive=True)}
    except psutil.NoSuchProcess:
        return None, []
    slab = f"/dev/shm/{prefix}-{pid}-"
    for proc in psutil.process_iter(["cmdline", "name"]):
        if proc.pid == pid or proc.pid in found:
            continue
        mine = proc.info["name"] == "mmsplit-cpu" and _maps(proc.pid, slab)
        if mine or proc.info["cmdline"] == command:
            found[proc.pid] = proc
    forkserver, workers = None, []
    for proc in found.values():
        try:
            name, line = proc.name(), " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if name == "mmsplit-cpu":
            workers.append(proc)
        elif name == "mmsplit-forksrv" or "multiprocessing.forkserver" in line:
            forkserver = proc
    return forkserver, workers


def _maps(pid: int, path: str) -> bool:
    """Whether process `pid` maps a file whose path starts with `path`."""
    try:
        with open(f"/proc/{pid}/maps") as maps:
            return any(path in line for line in maps)
    except OSError:
        return False


def private_shm() -> bool:
    """Whether /dev/shm here is not the host's: this run was re-executed in
    a mount namespace of its own (`--shm-size`), and /dev/shm is no longer
    the file system it was before (whose device the environment carries)."""
    host = os.environ.get(PRIVATE_SHM_ENV, "")
    return host.isdigit() and os.stat("/dev/shm").st_dev != int(host)


async def fill_shm(rng: random.Random) -> bool:
    """Fill this namespace's /dev/shm to within SHM_MARGIN of its limit
    (the pages reserved, as the services reserve theirs) for 1-4 s; whether
    it did."""
    if not private_shm():
        return False
    stat = os.statvfs("/dev/shm")
    size = stat.f_bavail * stat.f_frsize - SHM_MARGIN
    if size <= 0:
        return False
    path = f"/dev/shm/chaosfill-{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        with contextlib.suppress(OSError):  # someone took pages meanwhile: as full as it gets
            os.posix_fallocate(fd, 0, size)
        await asyncio.sleep(rng.uniform(1.0, 4.0))
    finally:
        os.close(fd)
        os.unlink(path)
    return True


async def inject(rng: random.Random, tokenizer_pid: int, groups: list[Group], every_s: float, stop_at: float,
                 tally: Tally, prefix: str) -> None:  # fmt: skip
    faults: tuple[str, ...] = (*FAULTS, SHM_FAULT) if private_shm() else FAULTS
    if all(group.tp == 1 for group in groups):  # no rank 1 to kill
        faults = tuple(f for f in faults if f != "rank1")
    while time.monotonic() < stop_at - every_s:
        await asyncio.sleep(rng.uniform(0.5, 1.5) * every_s)
        fault = rng.choice(faults)
        if fault == SHM_FAULT:
            tally.faults[fault if await fill_shm(rng) else f"{fault} (none to hit)"] += 1
            continue
        group = rng.choice(groups)
        forkserver, workers = tokenizer_tree(tokenizer_pid, prefix)
        ranks = group.ranks()
        target: psutil.Process | None = None
        if fault == "worker" and workers:
            target = rng.choice(workers)
        elif fault == "forkserver" and forkserver is not None:
            target = forkserver
        elif fault == "rank1" and len(ranks) > 1:
            target = ranks[1]
        elif fault == "group" and ranks:
            target = ranks[0]
        elif fault == "freeze" and len(ranks) >= group.tp:  # rank 1, or a group of one's only rank
            frozen = ranks[group.tp - 1]
            try:
                frozen.send_signal(signal.SIGSTOP)
                await asyncio.sleep(rng.uniform(0.5, 2.0))
                frozen.send_signal(signal.SIGCONT)
                tally.faults[fault] += 1
            except psutil.NoSuchProcess:
                # It ended before or while frozen (its group stopping after an
                # earlier fault): a 40-minute soak once ended here, unreported.
                tally.faults[f"{fault} (its rank ended)"] += 1
            continue
        if target is None:
            tally.faults[f"{fault} (none to hit)"] += 1
            continue
        try:
            target.send_signal(signal.SIGKILL)
            tally.faults[fault] += 1
        except psutil.NoSuchProcess:
            pass


async def keep_groups_up(groups: list[Group], stop_at: float, tally: Tally) -> None:
    while time.monotonic() < stop_at + DEADLINE_S:
        for group in groups:
            if await asyncio.to_thread(group.restart_if_dead):
                tally.faults["restarts"] += 1
        await asyncio.sleep(0.5)


def scraped(port: int, name: str) -> int:
    """A counter from the tokenizer's /metrics (0 when it is not there)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return int(float(line.rsplit(" ", 1)[1]))
    return 0


def footprint(pid: int) -> tuple[int, int]:
    proc = psutil.Process(pid)
    return proc.num_fds(), proc.memory_info().rss


def descriptor_kinds(pid: int) -> Counter[str]:
    """A process's open descriptors by kind: socket, pipe, anon_inode:[...], or the path."""
    kinds: Counter[str] = Counter()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                kinds[re.sub(r":\[\d+\]$", "", target)] += 1
    return kinds


def segments(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"{prefix}-"))


def tokenizer_info(address: str) -> tokenizer_pb2.GetServerInfoResponse:
    with grpc.insecure_channel(address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        return stub.GetServerInfo(tokenizer_pb2.GetServerInfoRequest(), timeout=30)


def slab_used(address: str) -> int:
    return int(tokenizer_info(address).info.shm_slab_used_bytes)


def every_backend_ready(address: str) -> bool:
    return all(b.ready for b in tokenizer_info(address).backends)


def wait_until(check: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.2)
    return False


async def load(args: argparse.Namespace, tok: ServiceProcess, http: str, groups: list[Group], tally: Tally) -> None:
    import openai

    rng = random.Random(args.seed)
    stop_at = time.monotonic() + args.minutes * 60
    api = openai.AsyncOpenAI(base_url=f"http://{http}/v1", api_key="none", max_retries=3)
    deck = Deck(random.Random(rng.random()))
    clients = [
        one(random.Random(rng.random()), deck, tok.address, tally, stop_at, api) for _ in range(args.concurrency)
    ]
    keeper = asyncio.ensure_future(keep_groups_up(groups, stop_at, tally))
    injector = asyncio.ensure_future(inject(random.Random(args.seed + 1), tok.pid, groups, args.fault_every_s,
                                            stop_at, tally, args.prefix))  # fmt: skip
    try:
        await asyncio.gather(*clients)
        await injector
    finally:
        keeper.cancel()
        await api.close()


def build_qwen(workdir: Path) -> Path:
    """The tiny Qwen2-VL (images and videos), built once in `workdir`."""
    from harness import ROOT

    from mmsplit_cli.tiny_model import build

    out = workdir / "model-qwen2-vl"
    return out if (out / "config.json").exists() else build(out, cache_dir=ROOT / ".cache", family="qwen2-vl")


async def warm_up(address: str) -> None:
    async with AsyncClient(address, retries=3) as client:
        await asyncio.gather(*(client.complete("Look.", images=[im], max_tokens=2) for im in IMAGES))


def grew(start: int, end: int) -> bool:
    """Resident bytes at the end past what the start allows: 10 % more,
    plus the free heap each service keeps (a scheduler's rank warmed up on
    a busy host was seen at 546 MiB and ended a 15 s run at 620, the
    plateau it reaches in every unloaded run: 590-620)."""
    return end > start * 1.1 + mallocheap.HEAP_TRIM_THRESHOLD


def run(args: argparse.Namespace, workdir: Path, model: Path | None = None) -> tuple[int, Tally]:
    """The soak (`args`: minutes, concurrency, seed, fault_every_s, prefix);
    the exit status and the tally. `model`: the tiny LLaVA's directory (else built here)."""
    model = model or build_qwen(workdir)
    MODEL_NAME[0] = model.name
    family = families.load(model)
    if family.image_pixels is not None:
        least = family.least_image_pixels
        BUDGETS[:] = [{}, {"max_pixels": 4 * least}, {"min_pixels": least, "max_pixels": family.image_pixels.most // 2}]
    prefix = args.prefix
    logs = workdir / "chaos-logs"
    logs.mkdir(exist_ok=True)
    caches = getattr(args, "caches", "on")
    off = caches == "off"
    sums = ["--tp-all-reduce", getattr(args, "tp_all_reduce", "shm")]
    tp = getattr(args, "tp", 2)
    more = [*sums, *(NO_CACHES["scheduler"] if off else []), *shlex.split(getattr(args, "scheduler_args", ""))]
    groups = [Group(f"scheduler{k}", model, logs, prefix, more, tp)
              for k in range(2)]  # fmt: skip
    tok: ServiceProcess | None = None
    tally = Tally()
    try:
        for g in groups:
            g.serve_first(180)
        schedulers = ",".join(f"127.0.0.1:{g.port}" for g in groups)
        for attempt in range(1, START_ATTEMPTS + 1):
            http, metrics = f"127.0.0.1:{free_port()}", free_port()
            extra = ["--shm-prefix", prefix, "--http-port", http.rsplit(":", 1)[1], "--cpu-workers", "2"]
            extra += ["--metrics-port", str(metrics)]
            extra += NO_CACHES["tokenizer"] if off else []
            tok = ServiceProcess("tokenizer", tokenizer_args(model, schedulers, extra=extra), logs / "tokenizer.log")
            try:
                tok.wait_serving(TOKENIZER_SERVICE, 180)
                break
            except StartFailed:
                # A port drawn free was bound by another process first: others.
                if not tok.port_taken() or attempt == START_ATTEMPTS:
                    raise
                tok.stop()
                tok.log_path.rename(tok.log_path.with_suffix(f".attempt{attempt}.log"))
        assert tok is not None  # (the loop breaks with one, or raises)
        # Warmed up first (the slab, the grant table, the workers, both
        # groups' channels), so the start is what the end is compared with.
        # The tokenizer serves once one group answers: a group it had not
        # found yet would take no warm-up and start cold.
        if not wait_until(lambda: every_backend_ready(tok.address), 60):
            raise RuntimeError("the tokenizer did not find both scheduler groups ready within 60 s")
        asyncio.run(warm_up(tok.address))
        fds0, rss0 = footprint(tok.pid)
        kinds0 = descriptor_kinds(tok.pid)
        ranks0 = [g.footprints() for g in groups]
        started = time.monotonic()
        asyncio.run(load(args, tok, http, groups, tally))
        took = time.monotonic() - started
        for g in groups:  # every group back before the books are closed
            g.serve_again(180)
        idle = wait_until(lambda: slab_used(tok.address) == 0, 60)
        fds1, rss1 = footprint(tok.pid)
        kinds1 = descriptor_kinds(tok.pid)
        ranks1 = [g.footprints() for g in groups]
        tally.grpc_retries = scraped(metrics, "mmsplit_tokenizer_grpc_retried_calls_total")
        mine = [n for n in segments(prefix) if n.startswith(f"{prefix}-{tok.pid}-")]
        left = [n for n in segments(prefix) if n not in mine]
    finally:
        if tok is not None:
            tok.stop()
        for g in groups:
            g.stop()
    total = sum(tally.outcomes.values())
    where = f"a /dev/shm of its own ({os.statvfs('/dev/shm').f_blocks * os.statvfs('/dev/shm').f_frsize >> 20} MiB)"
    print(f"{total} requests in {took:.0f}s by {args.concurrency} clients; seed {args.seed}; caches {caches}; "
          f"{where if private_shm() else 'the host /dev/shm'}")  # fmt: skip
    print(table(["outcome", "requests"], sorted(tally.outcomes.items(), key=lambda kv: -kv[1])))
    print(f"by kind: {dict(sorted(tally.kinds.items()))}")
    print(f"faults: {dict(tally.faults)}; retries: HTTP by the SDK {tally.retries}, gRPC by the channel "
          f"{tally.grpc_retries}")  # fmt: skip
    lat = tally.latencies
    print(f"latency of successes: p50 {percentile(lat, 50):.2f}s, p99 {percentile(lat, 99):.2f}s")
    print(f"left in /dev/shm besides the live tokenizer's slab and grant table: {left}; the tokenizer's own: {mine}")
    print(f"slab back to 0 bytes used: {idle}")
    changed = "; ".join(f"{kind} {kinds0[kind]} -> {kinds1[kind]}" for kind in sorted(kinds0 | kinds1)
                        if kinds0[kind] != kinds1[kind])  # fmt: skip
    print(f"tokenizer descriptors {fds0} -> {fds1} ({changed or 'the same kinds'}), "
          f"resident {rss0 >> 20} -> {rss1 >> 20} MiB")  # fmt: skip
    for g, before, after in zip(groups, ranks0, ranks1, strict=True):
        # A group restarted during the run is new processes: its end is
        # compared with the first one's start (what a group costs after a
        # start and under the load).
        print(f"{g.name} (started {g.starts} times): " + "; ".join(
            f"rank {r} descriptors {a[0]} -> {b[0]}, resident {a[1] >> 20} -> {b[1] >> 20} MiB"
            for r, (a, b) in enumerate(zip(before, after, strict=False))))  # fmt: skip
    problems = list(tally.bad)
    if left:
        problems.append(f"segments left: {left}")
    strays = [n for n in mine if "-slab" not in n and "-grant" not in n]
    if strays:
        problems.append(f"the tokenizer kept segments besides its slab and grant table: {strays}")
    if not idle:
        problems.append("slab slices stayed held")
    # The slab's spare descriptors (kept for the next slice's lock, up to a
    # bound per mode) fill as the load goes: they count apart, against it.
    slab0, slab1 = (sum(n for kind, n in kinds.items() if "-slab" in kind) for kinds in (kinds0, kinds1))
    if fds1 - slab1 > (fds0 - slab0) * 1.1 + 8:
        problems.append(f"descriptors grew {fds0} -> {fds1}, {slab0} -> {slab1} of them the slab's")
    if slab1 > slab0 + 2 * ranges.SPARE_DESCRIPTORS:
        problems.append(f"the slab's descriptors grew past its spares' bound: {slab0} -> {slab1}")
    if off and grew(rss0, rss1):
        problems.append(f"resident memory grew {rss0 >> 20} -> {rss1 >> 20} MiB with the caches off")
    for g, before, after in zip(groups, ranks0, ranks1, strict=True):
        for r, (a, b) in enumerate(zip(before, after, strict=False)):
            if b[0] > a[0] * 1.1 + 8 or (off and grew(a[1], b[1])):
                problems.append(f"{g.name} rank {r} grew: descriptors {a[0]} -> {b[0]}, resident {a[1] >> 20} -> "
                                f"{b[1] >> 20} MiB")  # fmt: skip
    for problem in problems[:20]:
        print("PROBLEM:", problem)
    return (1 if problems else 0), tally


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--fault-every-s", type=float, default=6.0)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--prefix", default="mmsplitchaos", help="the services' --shm-prefix")
    parser.add_argument("--shm-size", default="", help="run in a mount namespace with a tmpfs of this size on "
                        "/dev/shm (e.g. 1g; root only), and fill it as one of the faults")  # fmt: skip
    parser.add_argument("--caches", choices=("on", "off"), default="on",
                        help="off: the services' caches off, and resident memory checked")  # fmt: skip
    parser.add_argument("--tp", type=int, choices=(1, 2), default=2,
                        help="ranks per group (1: no rank 1 to kill; a freeze stops the group's one rank)")  # fmt: skip
    parser.add_argument("--tp-all-reduce", choices=("shm", "gloo"), default="shm",
                        help="the groups' TP sums: gloo as between hosts (a failed forward drains them)")  # fmt: skip
    parser.add_argument("--scheduler-args", default="",
                        help="more arguments for both groups, e.g. '--max-prefill-tokens 32'")  # fmt: skip
    args = parser.parse_args()
    if args.shm_size and not os.environ.get(PRIVATE_SHM_ENV):
        # The same command again, in a mount namespace with a /dev/shm of its own.
        root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, PRIVATE_SHM_ENV: str(os.stat("/dev/shm").st_dev), "PYTHONPATH": root}
        script = str(Path(sys.argv[0]).resolve())
        command = [sys.executable, "-m", "tests.support.mountns", args.shm_size, sys.executable, script, *sys.argv[1:]]
        os.chdir(root)
        os.execve(sys.executable, command, env)
    if args.shm_size and not private_shm():
        sys.exit("--shm-size: /dev/shm is still the host's; refusing to fill it")
    with scratch_dir(args.workdir) as workdir:
        sys.exit(run(args, workdir)[0])


if __name__ == "__main__":
    main()
