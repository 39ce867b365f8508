"""End to end through real servers on 127.0.0.1: tokenizer → shared memory →
scheduler with 2 tensor-parallel ranks → tokens."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import grpc
import pytest
import torch

from mmsplit.common.v1 import common_pb2
from mmsplit.errors import RemoteError
from mmsplit.tokenizer.v1 import tokenizer_pb2_grpc
from mmsplit_cli import samples
from mmsplit_cli.client import make_request, run_request
from tests.conftest import SCHEDULER_SERVICE, TOKENIZER_SERVICE, Services
from tests.e2e.helpers import health_status, rank_active_requests
from tests.support.faults import failing_request_id
from tests.support.leaks import project_segments, wait_until
from tests.support.logprobs import rank_within_ties

pytestmark = pytest.mark.e2e


@pytest.fixture
def stub(services: Services):  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(services.tokenizer_address) as channel:
        yield tokenizer_pb2_grpc.TokenizerServiceStub(channel)


def reference_greedy(model_dir: Path, prompt: str, images: list[bytes], max_tokens: int) -> list[int]:
    """The same request run in this process by the plain transformers model,
    no tensor parallelism, no services: the tokens the services must match."""

    from tests.support import hf_family, hf_loaded
    from tokenizer_svc.decode import decode_image

    processor = hf_family.processor(model_dir)
    inputs = hf_family.inputs(processor, prompt, [decode_image(b, max_pixels=10**8) for b in images])
    ids = inputs["input_ids"][0].tolist()
    pixels = list(inputs["pixel_values"]) if images else []
    model = hf_loaded.model(model_dir)
    eos = model.config.text_config.eos_token_id
    out: list[int] = []
    seq = torch.tensor([ids])
    with torch.inference_mode():
        for _ in range(max_tokens):
            kwargs = {"pixel_values": torch.stack(pixels)} if pixels else {}
            token = int(model(input_ids=seq, **kwargs).logits[0, -1].argmax())
            out.append(token)
            if token == eos:
                break
            seq = torch.cat([seq, torch.tensor([[token]])], dim=1)
    return out


def test_good_image_matches_single_process_model(stub, services: Services) -> None:
    image = samples.good_png(seed=5)
    out = run_request(stub, make_request("Describe the image.", [image], max_tokens=10))
    assert out.ok, out
    assert out.finish_reason in ("FINISH_REASON_LENGTH", "FINISH_REASON_STOP")
    assert out.token_ids == reference_greedy(services.model, "Describe the image.", [image], 10)
    assert out.text  # detokenized text came with the ids


def test_two_images_and_text_only(stub, services: Services) -> None:
    png, jpeg = samples.good_png(seed=6), samples.good_jpeg(seed=7)
    two = run_request(stub, make_request("<image> or <image>?", [png, jpeg], max_tokens=6))
    assert two.ok, two
    assert two.token_ids == reference_greedy(services.model, "<image> or <image>?", [png, jpeg], 6)
    text = run_request(stub, make_request("Once upon a time", max_tokens=6))
    assert text.ok, text
    assert text.token_ids == reference_greedy(services.model, "Once upon a time", [], 6)


def test_corrupt_png_is_a_typed_client_error_and_nothing_breaks(stub, services: Services) -> None:
    bad = run_request(stub, make_request("Describe.", [samples.corrupt_png()], request_id="corrupt-1"))
    assert bad.grpc_code == "INVALID_ARGUMENT"
    assert bad.reason == "MEDIA_DECODE_FAILED"
    good = run_request(stub, make_request("Describe.", [samples.good_png()], max_tokens=4))
    assert good.ok, good
    assert health_status(services.tokenizer_address, TOKENIZER_SERVICE) == "SERVING"
    assert health_status(services.scheduler_address, SCHEDULER_SERVICE) == "SERVING"


def test_read_failure_on_rank_1_fails_only_that_request(stub, services: Services) -> None:
    """Both requests reach the scheduler together (its test batch window is
    0.1 s); the injected rank-1 read failure aborts one on every rank while
    the other, admitted in the same step, completes."""
    image = samples.good_png(seed=8)
    tag = uuid.uuid4().hex[:8]
    bad_id, good_id = failing_request_id(1, tag), f"good-{tag}"
    results = {}
    barrier = threading.Barrier(2)

    def send(rid: str) -> None:
        barrier.wait()
        results[rid] = run_request(stub, make_request("Describe.", [image], max_tokens=5, request_id=rid), timeout=60)

    threads = [threading.Thread(target=send, args=(rid,)) for rid in (bad_id, good_id)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads), "a request hung"

    bad, good = results[bad_id], results[good_id]
    assert bad.grpc_code == "INTERNAL"
    assert bad.reason == "FEATURE_TRANSPORT_FAILED"
    assert bad.metadata.get("failed_ranks") == "1"
    assert good.ok, good
    assert len(good.token_ids) == 5
    admitted_together = [
        line
        for line in services.scheduler.log_path.read_text().splitlines()  # type: ignore[attr-defined]
        if f".{bad_id} failed" in line and "joined with" in line and good_id in line
    ]
    assert admitted_together, "the two requests were not admitted in the same step"
    assert wait_until(lambda: rank_active_requests(services.scheduler_address) == [0, 0], timeout=10)


def test_client_cancel_aborts_on_both_ranks_and_frees_segments(stub, services: Services) -> None:
    rid = f"cancel-{uuid.uuid4().hex[:8]}"
    call = stub.Generate(make_request("Tell a long story.", [samples.good_png()], max_tokens=500, request_id=rid))
    events = iter(call)
    first = next(events)
    assert first.HasField("delta")
    next(events)
    assert rank_active_requests(services.scheduler_address) == [1, 1]
    call.cancel()
    with pytest.raises(grpc.RpcError) as info:
        list(events)
    assert info.value.code() == grpc.StatusCode.CANCELLED
    log_path = services.scheduler.log_path  # type: ignore[attr-defined]
    assert wait_until(lambda: f".{rid} aborted on all 2 ranks" in log_path.read_text(), timeout=10)
    assert wait_until(lambda: rank_active_requests(services.scheduler_address) == [0, 0], timeout=10)
    assert wait_until(lambda: not project_segments(), timeout=10)


def test_generate_cli_json_success_and_error(services: Services, tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    good, bad = tmp_path / "good.png", tmp_path / "bad.png"
    good.write_bytes(samples.good_png())
    bad.write_bytes(samples.corrupt_png())
    base = [sys.executable, "-m", "mmsplit_cli", "generate", "--server", services.tokenizer_address, "--json"]
    ok = subprocess.run(
        [*base, "--image", str(good), "--max-tokens", "3", "Hi"], capture_output=True, text=True, timeout=120
    )
    assert ok.returncode == 0, ok.stderr
    lines = [json.loads(line) for line in ok.stdout.splitlines()]
    assert sum(len(e.get("token_ids", [])) for e in lines) == 3
    assert lines[-1]["finished"]["completion_tokens"] == 3
    scored = subprocess.run(
        [*base, "--prompt-logprobs", "2", "--max-tokens", "1", "Hi there"], capture_output=True, text=True, timeout=120
    )
    assert scored.returncode == 0, scored.stderr
    first, *_ = [json.loads(line) for line in scored.stdout.splitlines()]
    prompt = first["prompt"]
    assert len(prompt["token_ids"]) == len(prompt["logprobs"]) == len(prompt["ranks"]) == len(prompt["top_logprobs"])
    assert prompt["logprobs"][0] is None
    assert all(lp <= 0 for lp in prompt["logprobs"][1:])
    assert all(len(top) == 2 for top in prompt["top_logprobs"][1:])

    err = subprocess.run([*base, "--image", str(bad), "Hi"], capture_output=True, text=True, timeout=120)
    assert err.returncode == 2
    line = json.loads(err.stdout.strip().splitlines()[-1])
    assert line["error"]["code"] == "INVALID_ARGUMENT"
    assert line["error"]["reason"] == "MEDIA_DECODE_FAILED"
    assert line["error"]["message"]


def test_error_info_carries_request_id_and_retriable(stub) -> None:
    call = stub.Generate(make_request("x", [b"not an image at all"], request_id="rid-42"))
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    from mmsplit.errors import error_info_of

    details = error_info_of(info.value)
    assert details is not None
    assert details.domain == "mmsplit"
    assert details.reason == "MEDIA_UNSUPPORTED"
    assert details.metadata["request_id"] == "rid-42"
    assert details.metadata["retriable"] == "false"
    assert RemoteError.from_rpc_error(info.value).error_code == common_pb2.ERROR_CODE_MEDIA_UNSUPPORTED


def test_an_image_seen_before_is_served_from_both_caches(services: Services) -> None:
    """The tokenizer's preprocessing cache and the scheduler's encoder-output
    cache (both ranks) each count one miss, then one hit (the second request
    under a cache_salt of its own, so that the prefix cache does not serve
    the image first); the tokens are the same either way."""
    from mmsplit.tokenizer.v1 import tokenizer_pb2
    from tests.e2e.helpers import scheduler_info

    def info():  # type: ignore[no-untyped-def]
        with grpc.insecure_channel(services.tokenizer_address) as channel:
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
            return stub.GetServerInfo(tokenizer_pb2.GetServerInfoRequest(), timeout=5).info

    def encoder() -> tuple[int, int]:
        got = scheduler_info(services.scheduler_address)
        return got.encoder_cache_misses, got.encoder_cache_hits

    image = samples.good_png(seed=4242)  # sent by no other test
    with grpc.insecure_channel(services.tokenizer_address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        before, encoder_before = info(), encoder()
        first = run_request(stub, make_request("Describe it.", [image], max_tokens=4), timeout=60)
        between, encoder_between = info(), encoder()
        again = make_request("Describe it.", [image], max_tokens=4)
        again.cache_salt = "test_an_image_seen_before"
        second = run_request(stub, again, timeout=60)
        after, encoder_after = info(), encoder()
    assert first.ok, first
    assert second.ok, second
    assert second.token_ids == first.token_ids
    assert encoder_between == (encoder_before[0] + 1, encoder_before[1])
    assert encoder_after == (encoder_between[0], encoder_between[1] + 1)
    assert scheduler_info(services.scheduler_address).encoder_cache_bytes > 0
    assert (between.preprocess_cache_misses, between.preprocess_cache_hits) == (
        before.preprocess_cache_misses + 1,
        before.preprocess_cache_hits,
    )
    assert (after.preprocess_cache_misses, after.preprocess_cache_hits) == (
        between.preprocess_cache_misses,
        between.preprocess_cache_hits + 1,
    )
    assert after.preprocess_cache_bytes > 0


def test_each_finished_request_is_one_json_log_line_with_its_outcome(services: Services) -> None:
    """The shared tokenizer runs with --log-format json: every request ends in
    one record with its id, outcome (OK or the ErrorCode), tokens and timings."""
    import json

    ok_id, bad_id = f"log-ok-{uuid.uuid4().hex[:8]}", f"log-bad-{uuid.uuid4().hex[:8]}"
    with grpc.insecure_channel(services.tokenizer_address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        good = run_request(stub, make_request("Hi", [samples.good_png()], max_tokens=3, request_id=ok_id), timeout=60)
        bad = run_request(stub, make_request("Hi", [samples.corrupt_png()], request_id=bad_id), timeout=60)
    assert good.ok
    assert bad.reason == "MEDIA_DECODE_FAILED"

    def records() -> dict[str, dict]:  # type: ignore[type-arg]
        found = {}
        for line in services.tokenizer.log_path.read_text().splitlines():
            if line.startswith("{"):
                entry = json.loads(line)  # every JSON line parses
                if entry.get("request_id") in (ok_id, bad_id):
                    found[entry["request_id"]] = entry
        return found

    assert wait_until(lambda: len(records()) == 2, timeout=10)
    done = records()
    assert done[ok_id]["outcome"] == "OK"
    assert done[ok_id]["completion_tokens"] == 3
    assert done[ok_id]["images"] == 1
    assert done[ok_id]["client"] == "addr:127.0.0.1"  # who sent it, as --max-inflight-per-client counts
    assert 0 < done[ok_id]["ttft_s"] <= done[ok_id]["duration_s"]
    assert done[ok_id]["level"] == "INFO"
    assert done[bad_id]["outcome"] == "MEDIA_DECODE_FAILED"
    assert done[bad_id]["ttft_s"] is None
    # The scheduler (text logs here) has its own line for the request it ran.
    scheduler_log = services.scheduler.log_path  # type: ignore[attr-defined]
    assert wait_until(lambda: f".{ok_id} finished: OK, " in scheduler_log.read_text(), timeout=10)


SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}
GRAMMAR = 'start: ("a" | "the") " " PET\nPET: "cat" | "dog"'


def test_the_cli_takes_an_image_url_and_sampling_knobs_and_a_closed_pipe_is_no_error(
    services: Services, tmp_path: Path
) -> None:
    """`mmsplit generate --image data:... --json | head -1`: the same tokens
    as the image sent as bytes (with the penalty, bias, --json-schema,
    --choice, --grammar, --allowed-token-id and --bad-word flags: the tokens
    those fields give; --tokenize with --truncate-prompt-tokens counts the
    last tokens), and the reader leaving early ends
    the command quietly (exit 0, nothing on stderr)."""
    import base64
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT

    image = samples.encode(samples.gradient(64, 48, seed=21), "PNG")  # small: one argument holds at most 128 KiB
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    argv = [sys.executable, "-m", "mmsplit_cli", "generate", "--server", services.tokenizer_address]
    with grpc.insecure_channel(services.tokenizer_address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        plain = run_request(stub, make_request("Look.", [image], max_tokens=5))
        knobs = {"repetition_penalty": 1.8, "presence_penalty": 1.5, "logit_bias": {plain.token_ids[0]: -100.0}}
        same = run_request(stub, make_request("Look.", [image], max_tokens=5, **knobs))
        shaped = run_request(stub, make_request("Look.", [image], max_tokens=30, json_schema=SCHEMA, **knobs))
        chosen = run_request(stub, make_request("Look.", [image], max_tokens=30, choice=["up", "down"], **knobs))
        spoken = run_request(stub, make_request("Look.", [image], max_tokens=30, grammar=GRAMMAR, **knobs))
        allowed = sorted({*same.token_ids[:2], 300, 400})
        kept = run_request(stub, make_request("Look.", [image], max_tokens=5, allowed_token_ids=allowed, **knobs))
        banned = run_request(stub, make_request("Look.", [image], max_tokens=5, bad_words=["Look"], **knobs))
    assert set(kept.token_ids) <= set(allowed), kept
    assert chosen.text in ("up", "down"), chosen
    assert spoken.text in ("a cat", "a dog", "the cat", "the dog"), spoken
    assert same.token_ids != plain.token_ids
    assert shaped.ok, shaped
    assert isinstance(json.loads(shaped.text)["ok"], bool)
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    grammar_file = tmp_path / "pet.lark"
    grammar_file.write_text(GRAMMAR)
    for tokens, extra, expected in (
        ("5", [], same),
        ("30", ["--json-schema", f"@{schema_file}"], shaped),
        ("30", ["--choice", "up", "--choice", "down"], chosen),
        ("30", ["--grammar", f"@{grammar_file}"], spoken),
        ("5", [arg for t in allowed for arg in ("--allowed-token-id", str(t))], kept),
        ("5", ["--bad-word", "Look"], banned),
    ):
        done = subprocess.run(
            [*argv, "--image", url, "--max-tokens", tokens, "--json", "--repetition-penalty", "1.8",
             "--presence-penalty", "1.5", "--logit-bias", f"{plain.token_ids[0]}=-100", *extra, "Look."],
            capture_output=True, text=True, timeout=120, cwd=ROOT, check=True,
        )  # fmt: skip
        ids = [t for line in done.stdout.splitlines() for t in json.loads(line).get("token_ids", [])]
        assert ids == expected.token_ids, extra
    counted = [
        json.loads(subprocess.run([*argv, "--tokenize", "--json", *extra, "Look at the picture closely."],
                                  capture_output=True, text=True, timeout=120, cwd=ROOT, check=True).stdout)
        for extra in ([], ["--truncate-prompt-tokens", "3"])
    ]  # fmt: skip
    assert counted[1]["token_ids"] == counted[0]["token_ids"][-3:]

    proc = subprocess.Popen(
        [*argv, "--max-tokens", "200", "--min-tokens", "200", "--json", "Go on."],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    assert proc.stdout is not None
    assert proc.stdout.readline()
    proc.stdout.close()  # as `head -1` does
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert err == "", err


def test_info_and_health_commands(services: Services) -> None:
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "mmsplit_cli", *argv], capture_output=True, text=True, timeout=60, cwd=ROOT
        )

    tok = run("info", "--server", services.tokenizer_address)
    assert tok.returncode == 0, tok.stderr
    assert json.loads(tok.stdout)["info"]["model"] == services.model.name
    sched = run("info", "--server", services.scheduler_address)
    assert sched.returncode == 0, sched.stderr
    assert json.loads(sched.stdout)["info"]["tpSize"] == 2
    health = run("health", "--server", services.tokenizer_address)
    assert (health.returncode, health.stdout.splitlines()) == (0, ["(live): SERVING", f"{TOKENIZER_SERVICE}: SERVING"])
    gone = run("health", "--server", "127.0.0.1:9", "--timeout", "1")
    assert gone.returncode == 1


def test_side_servers_bind_the_service_s_host(services: Services) -> None:
    """The shared pair serves on 127.0.0.1 with /metrics on: every TCP port
    either service listens on is on 127.0.0.1: gRPC, /metrics (which bound
    0.0.0.0 whatever --host said), and the TP=2 group's rendezvous store
    (torch's own listened on every address, unauthenticated) and gloo."""
    import psutil

    for proc in (services.tokenizer, services.scheduler):
        listening = [
            c.laddr for c in psutil.Process(proc.pid).net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN
        ]
        assert len(listening) >= 2, (proc.name, listening)  # gRPC and /metrics
        # gRPC's listener is dual-stack: 127.0.0.1 shows in its IPv4-mapped form.
        assert {a.ip.removeprefix("::ffff:") for a in listening} == {"127.0.0.1"}, (proc.name, listening)


def test_prompt_logprobs_over_two_ranks_are_the_single_process_model_s(stub, services: Services) -> None:
    """An image prompt's prompt_logprobs through both services at TP=2 (the
    LM head's logits gathered to rank 0 in slices): the ids the model
    read, each one's log probability, rank and top 3 on log_softmax of one
    full forward in this process, before the first delta; the generated
    tokens are unchanged."""

    from tests.support import hf_family, hf_loaded
    from tokenizer_svc.decode import decode_image

    image = samples.good_png(seed=41)
    request = make_request("Describe it.", [image], max_tokens=3)
    request.sampling.prompt_logprobs = 3
    events = list(stub.Generate(request, timeout=60))
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[0] == "prompt_logprobs"
    assert kinds.count("prompt_logprobs") == 1
    scored = events[0].prompt_logprobs
    processor = hf_family.processor(services.model)
    inputs = hf_family.inputs(processor, "Describe it.", [decode_image(image, max_pixels=10**8)])
    ids = inputs["input_ids"][0].tolist()
    assert list(scored.token_ids) == ids
    model = hf_loaded.model(services.model)
    with torch.inference_mode():
        logits = model(input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"]).logits[0, :-1]
    expected = torch.log_softmax(logits.float(), dim=-1)
    assert len(scored.logprobs) == len(ids) - 1
    for k, (token, lp) in enumerate(zip(ids[1:], scored.logprobs, strict=True)):
        assert lp.logprob == pytest.approx(float(expected[k, token]), abs=1e-4), k
        assert rank_within_ties(lp.rank, expected[k], token), (k, lp.rank)
        assert list(lp.top_token_ids) == torch.topk(expected[k], 3).indices.tolist(), k
    generated = [t for e in events if e.WhichOneof("event") == "delta" for t in e.delta.token_ids]
    assert generated == reference_greedy(services.model, "Describe it.", [image], 3)
    # The client library's form of them.
    from mmsplit.client import Client

    with Client(services.tokenizer_address) as client:
        done = client.complete("Describe it.", images=[image], max_tokens=3, prompt_logprobs=3)
    assert done.prompt is not None
    assert done.prompt.token_ids == tuple(ids)
    assert done.prompt.logprobs[0] is None
    assert done.prompt.logprobs[1:] == pytest.approx([lp.logprob for lp in scored.logprobs], abs=1e-6)
    assert done.token_ids == generated


def test_ctrl_c_in_generate_cancels_the_request_and_says_no_traceback(services: Services) -> None:
    """Ctrl-C while the answer streams: the request is cancelled at the
    services (their logs say CANCELLED), and the command ends as a shell
    expects (exit 130), not with KeyboardInterrupt's traceback."""
    import os
    import signal
    import subprocess
    import sys
    import uuid

    from tests.conftest import ROOT

    rid = uuid.uuid4().hex
    argv = [sys.executable, "-m", "mmsplit_cli", "generate", "--server", services.tokenizer_address]
    argv += ["--request-id", rid, "--max-tokens", "4000", "--ignore-eos", "Tell me everything."]
    # SIGINT as a terminal's foreground job has it: a suite run in the
    # background (`... &`, nohup) starts with it ignored, and so would the
    # command (Python then installs no KeyboardInterrupt).
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert proc.stdout is not None
        assert os.read(proc.stdout.fileno(), 1), "the answer started streaming"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err.decode()
    assert b"Traceback" not in err, err.decode()
    log = services.tokenizer.log_path  # type: ignore[attr-defined]
    assert wait_until(lambda: f"request {rid} finished: CANCELLED" in log.read_text(), timeout=30), log.read_text()[
        -2000:
    ]


def test_generate_at_a_scheduler_s_port_says_which_port_it_wants(services: Services) -> None:
    """A scheduler asks every caller for its token; a tokenizer's gRPC port
    asks none. `mmsplit generate` pointed at the scheduler says so."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    argv = [sys.executable, "-m", "mmsplit_cli", "generate", "--server", services.scheduler_address, "hi"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip()
    assert line.startswith(f"mmsplit generate: {services.scheduler_address}: UNAUTHENTICATED: "), line
    assert line.endswith(
        "(a scheduler's port? mmsplit generate talks to a tokenizer: give its --port, 50052 by default)"
    )
