"""GPU checks of the serving engine, run by `tests/gpu/run.sh` on a machine
with CUDA (never by `make test`: CI has no GPU).

Each check prints one line "PASS|FAIL|INFO name: detail" and the summary is
written to OUT/summary.txt:
  - the group starts on CUDA with NCCL, the model in the dtype asked for;
  - 32 requests joining at random steps through the real services: their
    greedy tokens equal in-process `generate` on the same GPU (float32, so
    the comparison is exact; bfloat16 is measured by the benchmark);
  - seeded sampling (a CUDA generator per request) gives the same tokens
    alone and in a crowd;
  - the repetition penalty gives `generate`'s tokens with its own, and a
    logit_bias changes the token it bans; a json_schema request's answer
    is a document of its schema;
  - NaN pixels, pixels so large the logits are NaN, and a hostile
    temperature each fail their request alone with a typed error, and the
    group keeps serving (same pid, SERVING, the next request succeeds);
  - the CUDA-IPC hand-off: a tokenizer with a GPU pool is given CUDA IPC,
    its tokens equal shared memory's, a cancel leaves the pool empty, its
    SIGKILL leaves the scheduler serving;
  - a bfloat16 model gets its pixels in bfloat16 by CUDA IPC (half the
    bytes), with the tokens of float32 rows it casts itself;
  - two ranks on one GPU (TP=2): whether NCCL lets them share the device;
    then a read failure injected on rank 1 fails only its request (the
    agreement over NCCL), a prefill and a decode that raise inside the
    model on rank 1 fail only their requests (the NCCL sums drained), and
    rank 1 SIGKILLed fails the group within a bound.

    python tests/gpu/checks.py OUT_DIR [DEVICE]

DEVICE defaults to cuda; `cpu` runs the same script here as a dry run of
its logic (the NCCL check then fails, as it must).
"""

from __future__ import annotations

import random
import re
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from mmsplit.common.v1 import common_pb2  # noqa: E402
from mmsplit.errors import RemoteError, error_info_of  # noqa: E402
from mmsplit.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc  # noqa: E402
from mmsplit.tokenizer.v1 import tokenizer_pb2_grpc  # noqa: E402
from mmsplit_cli import samples  # noqa: E402
from mmsplit_cli.client import make_request, run_request  # noqa: E402
from mmsplit_cli.launch import SCHEDULER_SERVICE, ServiceProcess, running_pair, scheduler_args  # noqa: E402
from mmsplit_cli.tiny_model import build  # noqa: E402
from scheduler_svc.model import model_info  # noqa: E402
from tests.support.local_token import scheduler_channel  # noqa: E402
from tests.support.logprobs import rank_within_ties  # noqa: E402

RESULTS: list[tuple[str, str, str]] = []
DEVICE = sys.argv[2] if len(sys.argv) > 2 else "cuda"


def report(status: str, name: str, detail: str) -> None:
    RESULTS.append((status, name, detail))
    print(f"{status} {name}: {detail}", flush=True)


def check(name: str):  # type: ignore[no-untyped-def]
    def wrap(fn):  # type: ignore[no-untyped-def]
        def run(*args, **kwargs):  # type: ignore[no-untyped-def]
            try:
                fn(*args, **kwargs)
            except Exception as exc:
                report("FAIL", name, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}")

        return run

    return wrap


def hf_greedy(
    model_dir: Path, asks: list[tuple[str, list[bytes], int]], dtype: torch.dtype, **generate: float
) -> list[list[int]]:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from tests.support import hf_family
    from tokenizer_svc.decode import decode_image

    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype).to(DEVICE).eval()
    out = []
    with torch.inference_mode():
        for prompt, images, max_tokens in asks:
            made = hf_family.inputs(processor, prompt, [decode_image(b, max_pixels=10**8) for b in images])
            ids = made["input_ids"].to(DEVICE)
            extra = {"pixel_values": made["pixel_values"].to(DEVICE, dtype)} if images else {}
            made = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
                **extra,
                **generate,
            )
            out.append([int(t) for t in made[0, ids.shape[1] :]])
    return out


@check("structured output on CUDA")
def structured(address: str) -> None:
    """A json_schema request's answer is a document of its schema, ended by EOS."""
    from mmsplit.checks import SCHEMA, Failed, expect_a_document_of_the_schema

    with grpc.insecure_channel(address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        out = run_request(stub, make_request("Colors?", max_tokens=40, json_schema=SCHEMA), timeout=120)
    if not out.ok:
        report("FAIL", "structured output on CUDA", out.message)
        return
    try:
        expect_a_document_of_the_schema(out.text)
        report("PASS", "structured output on CUDA", repr(out.text))
    except Failed as exc:
        report("FAIL", "structured output on CUDA", str(exc))


@check("penalties and logit_bias on CUDA")
def penalties(address: str, model_dir: Path) -> None:
    """The repetition penalty's tokens equal `generate`'s with its own; a
    logit_bias of -100 on the plain first token changes it."""
    asks = [(f"Describe picture {i}.", [samples.good_jpeg(seed=700 + i)], 12) for i in range(4)]
    with grpc.insecure_channel(address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        penalized = [
            run_request(stub, make_request(p, im, max_tokens=n, repetition_penalty=1.5), timeout=120)
            for p, im, n in asks
        ]
        plain = run_request(stub, make_request(*asks[0][:2], max_tokens=4), timeout=120)
        banned = run_request(
            stub, make_request(*asks[0][:2], max_tokens=4, logit_bias={plain.token_ids[0]: -100.0}), timeout=120
        )
    expected = hf_greedy(model_dir, asks, torch.float32, repetition_penalty=1.5)
    same = sum(o.ok and o.token_ids == e for o, e in zip(penalized, expected, strict=True))
    biased = banned.ok and bool(banned.token_ids) and banned.token_ids[0] != plain.token_ids[0]
    status = "PASS" if same == len(asks) and biased else "FAIL"
    detail = f"repetition_penalty {same}/{len(asks)} equal generate's, bias {biased}"
    report(status, "penalties and logit_bias on CUDA", detail)


@check("prompt log probabilities on CUDA")
def prompt_scores(address: str, model_dir: Path) -> None:
    """An image prompt's prompt_logprobs (float32) are log_softmax of one HF
    forward of it on the same GPU, within 1e-3, ranks equal."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from tests.support import hf_family
    from tokenizer_svc.decode import decode_image

    image = samples.good_jpeg(seed=811)
    request = make_request("Describe it.", [image], max_tokens=1)
    request.sampling.prompt_logprobs = 1
    with grpc.insecure_channel(address) as channel:
        events = list(tokenizer_pb2_grpc.TokenizerServiceStub(channel).Generate(request, timeout=120))
    scored = events[0].prompt_logprobs
    processor = AutoProcessor.from_pretrained(model_dir)
    made = hf_family.inputs(processor, "Describe it.", [decode_image(image, max_pixels=10**8)])
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).to(DEVICE).eval()
    with torch.inference_mode():
        ids = made["input_ids"].to(DEVICE)
        logits = model(input_ids=ids, pixel_values=made["pixel_values"].to(DEVICE)).logits[0, :-1]
        expected = torch.log_softmax(logits.float(), dim=-1).cpu()
    targets = made["input_ids"][0, 1:].tolist()
    pairs = list(enumerate(zip(targets, scored.logprobs, strict=True)))
    worst = max(abs(lp.logprob - float(expected[k, t])) for k, (t, lp) in pairs)
    ranks = sum(rank_within_ties(lp.rank, expected[k], t) for k, (t, lp) in pairs)
    ok = list(scored.token_ids) == made["input_ids"][0].tolist() and worst < 1e-3 and ranks == len(targets)
    report(
        "PASS" if ok else "FAIL", "prompt log probabilities on CUDA", f"worst {worst:.1e}, ranks {ranks}/{len(targets)}"
    )


@check("continuous batching on CUDA equals generate")
def continuous_batching(address: str, model_dir: Path) -> None:
    rng = random.Random(5)
    asks = []
    for i in range(32):
        images = [samples.good_jpeg(seed=500 + 3 * i + k) for k in range(rng.choice([0, 1, 1, 2]))]
        asks.append((f"Request {i}:" + " tell me more" * rng.randrange(0, 8), images, rng.randrange(1, 25)))
    delays = [rng.uniform(0, 1.0) for _ in asks]

    def one(i: int):  # type: ignore[no-untyped-def]
        time.sleep(delays[i])
        with grpc.insecure_channel(address) as channel:
            prompt, images, max_tokens = asks[i]
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
            return run_request(stub, make_request(prompt, images, max_tokens=max_tokens), timeout=120)

    with ThreadPoolExecutor(32) as pool:
        outcomes = list(pool.map(one, range(32)))
    failed = [o for o in outcomes if not o.ok]
    if failed:
        raise AssertionError(f"{len(failed)} requests failed: {failed[0]}")
    expected = hf_greedy(model_dir, asks, torch.float32)
    same = sum(o.token_ids == e for o, e in zip(outcomes, expected, strict=True))
    status = "PASS" if same == 32 else "FAIL"
    report(status, "continuous batching on CUDA equals generate", f"{same}/32 requests token-identical (float32)")


@check("seeded sampling on CUDA does not depend on the batch")
def seeded(address: str) -> None:
    def req(seed: int):  # type: ignore[no-untyped-def]
        return make_request(
            "Invent.", [samples.good_png(seed=41)], max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=seed
        )

    with grpc.insecure_channel(address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        alone = run_request(stub, req(99))
        crowd = [make_request(f"Other {i}", max_tokens=20, temperature=0.7, seed=i + 1) for i in range(8)]
        barrier = threading.Barrier(9)

        def send(r):  # type: ignore[no-untyped-def]
            barrier.wait()
            return run_request(stub, r)

        with ThreadPoolExecutor(9) as pool:
            results = list(pool.map(send, [*crowd, req(99)]))
    ok = alone.ok and all(r.ok for r in results) and results[-1].token_ids == alone.token_ids
    report("PASS" if ok else "FAIL", "seeded sampling on CUDA does not depend on the batch", f"alone {alone.token_ids}")


def direct(address: str, ids: list[int], images: list[common_pb2.TensorRef], sampling: common_pb2.SamplingParams):  # type: ignore[no-untyped-def]
    request = scheduler_pb2.GenerateRequest(
        request_id=f"gpu-{random.randrange(1 << 30)}", input_ids=ids, pixel_values=images, sampling=sampling
    )
    with scheduler_channel(address) as channel:
        try:
            list(scheduler_pb2_grpc.SchedulerServiceStub(channel).Generate(request, timeout=60))
        except grpc.RpcError as exc:
            if error_info_of(exc) is None:
                return f"UNTYPED {exc.code()}"
            return RemoteError.from_rpc_error(exc).reason
    return "ok"


@check("hostile requests fail alone on CUDA")
def hostile(pair, model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    info = model_info(model_dir)
    ids = [1, *([info.image_token_id] * info.tokens_per_image), 22557, 1526]
    shape = [3, 224, 224]

    def pixels(fill: float | None) -> common_pb2.TensorRef:
        array = np.random.default_rng(1).random(shape, dtype=np.float32)
        if fill is not None:
            array[:] = fill
        return common_pb2.TensorRef(dtype=common_pb2.DTYPE_FLOAT32, shape=shape, inline=array.tobytes())

    sampled = common_pb2.SamplingParams(max_tokens=4, temperature=0.8)
    got = {
        "NaN pixels": direct(pair.scheduler_address, ids, [pixels(float("nan"))], sampled),
        "huge pixels": direct(pair.scheduler_address, ids, [pixels(3e38)], sampled),
        "temperature 1e-39": direct(
            pair.scheduler_address, ids[:1] + ids[-2:], [], common_pb2.SamplingParams(temperature=1e-39)
        ),
        "good": direct(pair.scheduler_address, ids, [pixels(None)], common_pb2.SamplingParams(max_tokens=4)),
    }
    want = {"NaN pixels": "INVALID_REQUEST", "huge pixels": "INTERNAL", "temperature 1e-39": "INVALID_REQUEST"}
    alive = pair.scheduler.proc.poll() is None
    ok = all(got[k] == v for k, v in want.items()) and got["good"] == "ok" and alive
    report("PASS" if ok else "FAIL", "hostile requests fail alone on CUDA", f"{got}; scheduler alive: {alive}")


@check("two ranks on one GPU")
def two_ranks_one_gpu(model_dir: Path, logs: Path) -> None:
    """TP=2 with both ranks on the one GPU, over NCCL when DEVICE is cuda:
    a request; a read failure injected on rank 1 fails only its request
    (the agreement over NCCL); rank 1 SIGKILLed fails the group within a bound."""
    extra = ["--device", DEVICE, "--tensor-reader", "tests.support.faults:make_reader", "--collective-timeout-s", "20"]
    # Failures injected inside the model (tests/support/faults.py); the sums
    # over the group's backend, as on GPUs (a CPU dry run: gloo, not shared memory).
    extra += ["--engine-hook", "tests.support.faults", "--tp-all-reduce", "gloo"]
    # More KV budget than any GPU has: each rank must warn at start (it is
    # only a budget: nothing is allocated up front).
    extra += ["--kv-cache-bytes", str(1 << 41)]
    proc = ServiceProcess("scheduler-tp2", scheduler_args(model_dir, tp=2, extra=extra), logs / "tp2.log")
    try:
        proc.wait_serving(SCHEDULER_SERVICE, 120)
        memory_warnings(proc.log_path.read_text())
        with scheduler_channel(proc.address) as channel:
            request = scheduler_pb2.GenerateRequest(
                request_id="tp2", input_ids=[1, 22557, 1526], sampling=common_pb2.SamplingParams(max_tokens=8)
            )
            events = list(scheduler_pb2_grpc.SchedulerServiceStub(channel).Generate(request, timeout=60))
        report("PASS", "two ranks on one GPU", f"TP=2 served a request ({len(events)} events)")
    except Exception as exc:
        tail = proc.tail(8).strip().splitlines()
        reason = next((line for line in tail if "Duplicate GPU" in line or "NCCL" in line), tail[-1] if tail else "")
        report("INFO", "two ranks on one GPU", f"not possible here: {type(exc).__name__}; {reason[-300:]}")
        proc.stop()
        return
    try:
        rank1_read_failure(proc.address, model_dir)
        rank1_forward_failure(proc.address)
        rank_killed(proc)
    finally:
        proc.stop()


@check("each rank warns when the KV budget and caches may outgrow its GPU")
def memory_warnings(log: str) -> None:
    if DEVICE != "cuda":
        report("INFO", "memory warning", "CUDA only: not checked on " + DEVICE)
        return
    warned = sorted({rank for rank in ("0", "1") if f"rank {rank}: --kv-cache-bytes 2048.00 GiB" in log})
    assert warned == ["0", "1"], f"ranks that warned: {warned}; log tail: {log[-600:]}"
    report("PASS", "memory warning", "both ranks named --kv-cache-bytes over their free memory")


@check("a read failure on rank 1 fails only its request (TP=2)")
def rank1_read_failure(address: str, model_dir: Path) -> None:
    from tests.support.faults import failing_request_id

    info = model_info(model_dir)
    ids = [1, *([info.image_token_id] * info.tokens_per_image), 22557, 1526]
    array = np.random.default_rng(2).random((3, 224, 224), dtype=np.float32)
    pixels = common_pb2.TensorRef(dtype=common_pb2.DTYPE_FLOAT32, shape=[3, 224, 224], inline=array.tobytes())

    def send(rid: str):  # type: ignore[no-untyped-def]
        request = scheduler_pb2.GenerateRequest(
            request_id=rid, input_ids=ids, pixel_values=[pixels], sampling=common_pb2.SamplingParams(max_tokens=4)
        )
        with scheduler_channel(address) as channel:
            try:
                list(scheduler_pb2_grpc.SchedulerServiceStub(channel).Generate(request, timeout=60))
            except grpc.RpcError as exc:
                error = RemoteError.from_rpc_error(exc)
                return f"{error.reason} failed_ranks={error.metadata.get('failed_ranks')}"
        return "ok"

    with ThreadPoolExecutor(2) as pool:
        bad, good = pool.map(send, [failing_request_id(1, "gpu"), "good-beside-it"])
    ok = bad == "FEATURE_TRANSPORT_FAILED failed_ranks=1" and good == "ok"
    report("PASS" if ok else "FAIL", "a read failure on rank 1 fails only its request (TP=2)", f"{bad}; other: {good}")


@check("a forward that raises on rank 1 fails only its request (TP=2)")
def rank1_forward_failure(address: str) -> None:
    """Inside the model on rank 1 only, in a prefill and then in a decode:
    rank 1 makes the forward's sums rank 0 still waits in
    (scheduler_svc/counted_sums.py), both meet in the agreement, the request
    fails alone and at once (each call's deadline, 15 s, is inside the
    collective timeout, 20 s), and the group serves the next one."""
    got = {}
    for rid in ("inject-forward-failure-rank1-gpu", "inject-decode-failure-rank1-gpu", "good-after-them"):
        request = scheduler_pb2.GenerateRequest(
            request_id=rid, input_ids=[1, 22557, 1526], sampling=common_pb2.SamplingParams(max_tokens=4, min_tokens=4)
        )
        with scheduler_channel(address) as channel:
            try:
                events = list(scheduler_pb2_grpc.SchedulerServiceStub(channel).Generate(request, timeout=15))
                got[rid] = f"ok ({len(events)} events)"
            except grpc.RpcError as exc:
                got[rid] = RemoteError.from_rpc_error(exc).reason
    want = ["INTERNAL", "INTERNAL"]
    ok = list(got.values())[:2] == want and got["good-after-them"].startswith("ok")
    report("PASS" if ok else "FAIL", "a forward that raises on rank 1 fails only its request (TP=2)", f"{got}")


@check("rank 1 SIGKILLed fails the group cleanly (TP=2)")
def rank_killed(proc: ServiceProcess) -> None:
    import os
    import signal

    request = scheduler_pb2.GenerateRequest(
        request_id="long",
        input_ids=[1, 22557, 1526],
        sampling=common_pb2.SamplingParams(max_tokens=4000, min_tokens=4000),
    )
    outcome: list[str] = []
    with scheduler_channel(proc.address) as channel:
        call = scheduler_pb2_grpc.SchedulerServiceStub(channel).Generate(request, timeout=120)
        events = iter(call)
        next(events)
        # Rank 1's pid, from its own log line ("INFO <pid> scheduler_svc.ranks: rank 1 ready").
        ready = re.search(r" (\d+) scheduler_svc\.ranks: rank 1 ready", proc.log_path.read_text())
        assert ready is not None, "rank 1 never logged that it was ready"
        victim = int(ready[1])
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        try:
            for _ in events:
                pass
            outcome.append("ended without an error")
        except grpc.RpcError as exc:
            outcome.append(RemoteError.from_rpc_error(exc).reason)
        failed_after = time.monotonic() - killed
    try:
        code = proc.proc.wait(timeout=60)
    except Exception:
        code = None
    exited_after = time.monotonic() - killed
    ok = outcome == ["SCHEDULER_UNAVAILABLE"] and code is not None and failed_after < 30
    detail = f"request: {outcome[0]} after {failed_after:.1f}s; scheduler exited {code} after {exited_after:.1f}s"
    report("PASS" if ok else "FAIL", "rank 1 SIGKILLed fails the group cleanly (TP=2)", detail)


def open_pools(address: str) -> int:
    """The CUDA IPC pools the scheduler at `address` holds open (rank 0's)."""
    with scheduler_channel(address) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        return int(stub.GetServerInfo(scheduler_pb2.GetServerInfoRequest(), timeout=5).info.cuda_ipc_open_pools)


@check("CUDA IPC hand-off")
def cuda_ipc(pair, model_dir: Path, logs: Path) -> None:  # type: ignore[no-untyped-def]
    """A tokenizer with a GPU staging pool on the pair's scheduler: CUDA IPC is
    chosen, its greedy tokens equal the pair's own tokenizer's with the pool
    off (shared memory), a cancel leaves the pool's used bytes at 0, and a
    SIGKILL of that tokenizer leaves the scheduler serving and, once a
    janitor has removed the dead tokenizer's lease map, its pool closed on
    the ranks (rank 0's count of open pools goes down by one)."""
    import os
    import signal

    from mmsplit.tokenizer.v1 import tokenizer_pb2
    from mmsplit_cli.launch import TOKENIZER_SERVICE, tokenizer_args

    def info(address: str):  # type: ignore[no-untyped-def]
        with grpc.insecure_channel(address) as channel:
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
            return stub.GetServerInfo(tokenizer_pb2.GetServerInfoRequest(), timeout=5)

    extra = ["--janitor-interval-s", "1", "--segment-grace-s", "1"]
    tok = ServiceProcess(
        "tokenizer-ipc", tokenizer_args(model_dir, pair.scheduler_address, extra=extra), logs / "ipc.log"
    )
    try:
        tok.wait_serving(TOKENIZER_SERVICE, 120)
        got = info(tok.address)
        if got.transport != common_pb2.TRANSPORT_CUDA_IPC:
            chosen = common_pb2.Transport.Name(got.transport)
            gpus = f"scheduler {list(got.scheduler.cuda_device_uuids)}, ours {list(got.info.cuda_device_uuids)}"
            raise AssertionError(f"transport {chosen}; GPUs: {gpus}")
        same = 0
        for seed in range(4):
            image = samples.good_jpeg(seed=900 + seed)
            outs = []
            for address in (tok.address, pair.tokenizer_address):
                with grpc.insecure_channel(address) as channel:
                    stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
                    outs.append(run_request(stub, make_request("Describe it.", [image], max_tokens=8), timeout=60))
            same += outs[0].ok and outs[0].token_ids == outs[1].token_ids
        with grpc.insecure_channel(tok.address) as channel:
            call = tokenizer_pb2_grpc.TokenizerServiceStub(channel).Generate(
                make_request("Go on.", [samples.good_png(seed=950)], max_tokens=500)
            )
            next(iter(call))
            call.cancel()
        time.sleep(1.0)
        used = info(tok.address).info.cuda_ipc_pool_used_bytes
        opened = open_pools(pair.scheduler_address)
        os.kill(tok.pid, signal.SIGKILL)
        time.sleep(3.0)
        alive = pair.scheduler.proc.poll() is None
        # The scheduler's janitor (every 30 s by default) removes the lease map.
        deadline = time.monotonic() + 45
        while open_pools(pair.scheduler_address) >= opened and time.monotonic() < deadline:
            time.sleep(0.5)
        closed = open_pools(pair.scheduler_address) == opened - 1
        ok = same == 4 and used == 0 and alive and opened >= 1 and closed
        detail = (
            f"{same}/4 token-identical to shared memory; pool used after a cancel: {used}; "
            f"scheduler alive after the tokenizer's SIGKILL: {alive}; open pools {opened} before, "
            f"{open_pools(pair.scheduler_address)} after"
        )
        report("PASS" if ok else "FAIL", "CUDA IPC hand-off", detail)
    finally:
        tok.stop()


@check("bfloat16 pixels")
def bfloat16_pixels(model_dir: Path, logs: Path) -> None:
    """A bfloat16 scheduler says so (`encoder_input_dtype`), and a tokenizer
    with a GPU pool stages its pixels in bfloat16 (by CUDA IPC; by shared
    memory in a dry run on the CPU): half the bytes of float32 kept per
    image, and the tokens of float32 rows sent straight to the scheduler,
    which casts them on the GPU itself."""
    from mmsplit.tokenizer.v1 import tokenizer_pb2
    from tests.support import family_kit
    from tokenizer_svc.decode import decode_image

    def info(address: str):  # type: ignore[no-untyped-def]
        with grpc.insecure_channel(address) as channel:
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
            return stub.GetServerInfo(tokenizer_pb2.GetServerInfoRequest(), timeout=5)

    (logs / "bfloat16").mkdir(exist_ok=True)
    with running_pair(
        model_dir, logs / "bfloat16", tp=1, scheduler_extra=["--device", DEVICE, "--dtype", "bfloat16"]
    ) as pair:
        got = info(pair.tokenizer_address)
        wanted = common_pb2.TRANSPORT_CUDA_IPC if DEVICE == "cuda" else common_pb2.TRANSPORT_SHM
        if got.transport != wanted or got.scheduler.encoder_input_dtype != common_pb2.DTYPE_BFLOAT16:
            raise AssertionError(f"transport {got.transport}, encoder_input_dtype {got.scheduler.encoder_input_dtype}")
        kit = family_kit.kit(model_dir)
        prompt = f"{kit.marker}\nDescribe it."
        same, halves = 0, 0
        for seed in range(4):
            jpeg = samples.good_jpeg(seed=960 + seed)
            direct = kit.message(f"float32-{seed}", prompt, [decode_image(jpeg, max_pixels=10**8)], 8)
            direct.sampling.min_tokens = 8
            float32_bytes = len(direct.items[0].tensors["pixel_values"].inline)
            kept = info(pair.tokenizer_address).info.preprocess_cache_bytes
            with grpc.insecure_channel(pair.tokenizer_address) as channel:
                stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
                out = run_request(stub, make_request(prompt, [jpeg], max_tokens=8, min_tokens=8), timeout=60)
            halves += info(pair.tokenizer_address).info.preprocess_cache_bytes - kept == float32_bytes // 2
            with scheduler_channel(pair.scheduler_address) as channel:
                events = list(scheduler_pb2_grpc.SchedulerServiceStub(channel).Generate(direct, timeout=60))
            expected = [t for e in events if e.HasField("tokens") for t in e.tokens.token_ids]
            same += out.ok and out.token_ids == expected and len(expected) == 8
        used = info(pair.tokenizer_address).info.cuda_ipc_pool_used_bytes
        ok = same == 4 and halves == 4 and used == 0
        detail = (
            f"{same}/4 token-identical to float32 rows; {halves}/4 kept at half the float32 bytes; pool used {used}"
        )
        report("PASS" if ok else "FAIL", "bfloat16 pixels", detail)


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(0) if DEVICE == "cuda" else DEVICE
    report("INFO", "device", f"{name}, torch {torch.__version__}")
    model_dir = build(out / "tiny", cache_dir=ROOT / ".cache", chat_template=False)  # prompts as written, as generate
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    started = time.monotonic()
    # The pair's tokenizer sends by shared memory (no GPU pool): the CUDA-IPC
    # check compares a tokenizer with a pool against it.
    scheduler = ["--device", DEVICE, "--dtype", "float32"]
    tokenizer = ["--cuda-ipc-pool-bytes", "0"]
    with running_pair(model_dir, logs, tp=1, scheduler_extra=scheduler, tokenizer_extra=tokenizer) as pair:
        log = pair.scheduler.log_path.read_text()
        if "may be held on this device" in log:
            report("FAIL", "memory warning", "the defaults fit this GPU, yet rank 0 warned")
        nccl = "nccl group" in log
        report(
            "PASS" if nccl else "FAIL",
            "group on CUDA with NCCL",
            "rank 0 joined the nccl group" if nccl else log[-500:],
        )
        # The lean decode's start-up probe compares it bit for bit with the
        # model's own forward on this device; the tokens checks below then run through it.
        lean = next((line for line in log.splitlines() if "decode steps run" in line), "")
        used = "without its module calls" in lean
        report("PASS" if used else "FAIL", "lean decode on the device", lean[-300:] or log[-500:])
        continuous_batching(pair.tokenizer_address, model_dir)
        seeded(pair.tokenizer_address)
        penalties(pair.tokenizer_address, model_dir)
        structured(pair.tokenizer_address)
        prompt_scores(pair.tokenizer_address, model_dir)
        hostile(pair, model_dir)
        cuda_ipc(pair, model_dir, logs)
    bfloat16_pixels(model_dir, logs)
    two_ranks_one_gpu(model_dir, logs)
    lines = [f"{s} {n}: {d.splitlines()[0] if d else ''}" for s, n, d in RESULTS]
    lines.append(f"checks took {time.monotonic() - started:.0f} s")
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if any(s == "FAIL" for s, _, _ in RESULTS) else 0


if __name__ == "__main__":
    sys.exit(main())
