"""Start-up mistakes as a user makes them: each is one line on stderr naming
the problem, exit status 2, no traceback, and nothing loaded (the services
are started as new interpreters here, as a user starts them, and end in a
few seconds; those that fail after loading, at their bind, are forks of the
suite's zygote)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from mmsplit_cli import launch
from tests.support.bench import completed
from tests.support.leaks import wait_until
from tests.support.services import ENV, ROOT, forked_script

pytestmark = pytest.mark.e2e


def start(service: str, model: str, *extra: str) -> tuple[int, list[str], float]:
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "mmsplit_cli", service, "--model", model, *extra],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, **ENV},
        check=False,
    )
    return done.returncode, done.stderr.strip().splitlines(), time.monotonic() - began


@pytest.fixture(scope="module")
def not_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("not-models")
    empty = root / "empty"
    empty.mkdir()
    text_only = root / "text-only"
    text_only.mkdir()
    (text_only / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    return {"empty": empty, "text-only": text_only, "missing": root / "nope"}


SERVICES = {
    "scheduler": ["--tp", "1", "--port", "0"],
    "tokenizer": ["--port", "0", "--http-port", "0", "--scheduler", "127.0.0.1:9"],
}


@pytest.mark.parametrize("service", list(SERVICES))
def test_model_mistakes_are_one_line_before_anything_loads(service: str, not_models: dict[str, Path]) -> None:
    cases = {
        str(not_models["missing"]): "no such directory (give a local checkpoint directory)",
        "llava-hf/llava-1.5-7b-hf": "looks like a Hugging Face Hub id",
        str(not_models["empty"]): "not a model directory (it has no config.json)",
        str(not_models["text-only"]): "model type 'llama' is not supported",
    }
    for model, says in cases.items():
        code, lines, took = start(service, model, *SERVICES[service])
        assert code == 2, (service, model, lines)
        assert len(lines) == 1, (service, model, lines)
        assert lines[0].startswith(f"mmsplit {service}: --model {model}: "), lines
        assert says in lines[0], lines
        assert took < 30, f"{service} took {took:.1f}s to refuse {model}: it loaded something"


@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
@pytest.mark.parametrize("service", list(SERVICES))
def test_a_port_in_use_is_one_line_before_the_model_loads(
    service: str, flag: str, chat_models: Callable[[str], Path]
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, lines, _ = start(service, str(chat_models("llava")), *SERVICES[service], flag, str(port))
    assert code == 2, lines
    assert lines == [
        f"mmsplit {service}: {flag} {port}: 127.0.0.1:{port} cannot be bound (Address already in use): "
        "stop what holds it, or pick another"
    ]


@pytest.mark.parametrize(
    ("service", "extra", "env", "setting"),
    [
        ("scheduler", ["--tp", "3", "--port", "0"], {}, "--tp 3"),
        (
            "scheduler",
            ["--launch", "env", "--port", "0"],
            {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
            "WORLD_SIZE 4",
        ),
        ("serve", ["--tp", "3", "--port", "0", "--http-port", "0"], {}, "--tp 3"),
    ],
)
def test_a_tp_size_that_splits_a_head_is_one_line_before_anything_loads(
    service: str,
    extra: list[str],
    env: dict[str, str],
    setting: str,
    chat_models: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """transformers' TP gives each rank whole attention and key-value heads:
    any other size used to load the model on every rank, then fail in the
    first forward with a view's shape error from each of them."""
    model = chat_models("qwen2-vl")
    config = json.loads((model / "config.json").read_text())
    text = config.get("text_config") or config
    heads, kv_heads = text["num_attention_heads"], text["num_key_value_heads"]
    assert (heads, kv_heads) == (4, 2), "the tiny models' heads: the sizes below are chosen for them"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, lines, took = start(service, str(model), *extra)
    assert code == 2, lines
    assert lines == [
        f"mmsplit {service}: {setting}: the text model has 4 attention heads and 2 key-value heads, and each rank "
        "takes whole heads of both: pick a TP size that divides both (1, 2)"
    ]
    assert took < 30, f"{service} took {took:.1f}s to refuse {setting}: it loaded something"


def test_cuda_asked_of_a_host_without_a_gpu_is_one_line_before_the_model_loads(
    chat_models: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """It was a ZeroDivisionError's traceback (the rank's GPU is its rank
    modulo the GPUs torch sees), after the group's rendezvous. Found with
    torch imported, after the checks of the files (exit status 1, as theirs)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU, on a host with GPUs too
    code, lines, took = start("scheduler", str(chat_models("llava")), "--device", "cuda", "--port", "0")
    assert code == 1, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith("mmsplit scheduler: --device cuda: this process sees no CUDA device"), lines
    assert took < 30, f"took {took:.1f}s to refuse: it loaded something"


def test_a_checkpoint_missing_its_weights_or_processor_is_one_line(
    chat_models: Callable[[str], Path], tmp_path: Path
) -> None:
    """Half a download: each was a traceback from transformers on every
    rank, after the group formed (the weights' before anything loads now;
    the processor's once torch is imported, before the group forms)."""
    no_weights, no_processor = tmp_path / "no-weights", tmp_path / "no-processor"
    # Qwen's family reads its processor's configuration (its pixel budget); LLaVA's scheduler needs none.
    for model, copy, left_out in (
        (chat_models("llava"), no_weights, ".safetensors"),
        (chat_models("qwen2-vl"), no_processor, "preprocessor_config.json"),
    ):
        copy.mkdir()
        for f in model.iterdir():
            if f.is_file() and not f.name.endswith(left_out):
                shutil.copy(f, copy / f.name)
    says = "no weights in it (no *.safetensors, no pytorch_model*.bin)"
    for service, extra in (("scheduler", ["--port", "0"]), ("serve", ["--port", "0", "--http-port", "0"])):
        code, lines, took = start(service, str(no_weights), *extra)
        assert code == 2, lines
        assert len(lines) == 1, lines
        assert lines[0].startswith(f"mmsplit {service}: --model {no_weights}: {says}"), lines
        assert took < 30, f"{service} took {took:.1f}s to refuse: it loaded something"
    code, lines, _ = start("scheduler", str(no_processor), "--port", "0")
    assert code == 1, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"mmsplit scheduler: --model {no_processor}: Can't load image processor"), lines


def test_env_launch_without_its_rendezvous_is_one_line(
    chat_models: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """It was torch's ValueError with its traceback, one variable at a time."""
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LWS_WORKER_INDEX"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "1")
    code, lines, took = start("scheduler", str(chat_models("llava")), "--launch", "env", "--port", "0")
    assert code == 2, lines
    assert lines == [
        "mmsplit scheduler: --launch env joins its group by torch's env:// rendezvous: WORLD_SIZE, MASTER_ADDR, "
        "MASTER_PORT not set (set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, or run under a LeaderWorkerSet, "
        "whose LWS_WORKER_INDEX, LWS_GROUP_SIZE and LWS_LEADER_ADDRESS stand for the first three)"
    ]
    assert took < 30


def test_tp_sizes_are_checked_against_both_head_counts(tmp_path: Path) -> None:
    from mmsplit_cli.startup import tp_problem

    def problem(config: dict[str, object], tp: int) -> str:
        (tmp_path / "config.json").write_text(json.dumps(config))
        return tp_problem(tmp_path, tp)

    llava = {"model_type": "llava", "text_config": {"num_attention_heads": 32, "num_key_value_heads": 8}}
    assert [tp for tp in range(1, 10) if not problem(llava, tp)] == [1, 2, 4, 8]
    assert "(1, 2, 4, 8)" in problem(llava, 16)
    # Qwen2-VL's older configs keep the text model's fields at the top level.
    qwen = {"model_type": "qwen2_vl", "num_attention_heads": 28, "num_key_value_heads": 4}
    assert [tp for tp in range(1, 10) if not problem(qwen, tp)] == [1, 2, 4]
    # No num_key_value_heads: as many as the attention heads.
    mha = {"model_type": "llava", "text_config": {"num_attention_heads": 12}}
    assert [tp for tp in range(1, 13) if not problem(mha, tp)] == [1, 2, 3, 4, 6, 12]
    # Nothing to check against: the load says what it says.
    assert problem({"model_type": "llava", "text_config": {}}, 3) == ""


def test_a_tokenizer_waiting_for_its_scheduler_says_so_at_once(tiny_model: Path, tmp_path: Path) -> None:
    from mmsplit_cli.launch import ServiceProcess, tokenizer_args

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{s.getsockname()[1]}"
    tok = ServiceProcess("tokenizer", tokenizer_args(tiny_model, nobody), tmp_path / "tokenizer.log", env=ENV)
    try:
        tok.wait_logged(f"waiting for a scheduler at {nobody}; serving NOT_SERVING until one answers", 120)
        assert tok.proc.poll() is None
    finally:
        assert tok.stop() == 0


def test_the_hub_id_hint_names_a_command_that_exists() -> None:
    """The refusal of a Hub id says how to download it with the command the
    installed huggingface_hub really ships (`hf`; `huggingface-cli` is gone)."""
    from mmsplit_cli.startup import model_problem

    problem = model_problem(Path("llava-hf/llava-1.5-7b-hf"))
    command = re.search(r"\((hf download \S+ --local-dir DIR)\)", problem)
    assert command, problem
    hf = Path(sys.executable).parent / "hf"
    shown = subprocess.run([str(hf), "download", "--help"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "--local-dir" in shown.stdout


def test_a_port_taken_between_choice_and_bind_starts_the_pair_again(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`running_pair` draws a `FreePort` at each attempt: when another
    process binds one first (a race a check cannot close), the service that
    cannot bind it exits at once (not after the start timeout) and the pair
    starts again with new ports."""
    from tests.support.services import FreePort, running_pair

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        draws = iter([None, port])  # the scheduler's port, then the tokenizer's metrics port
        real = launch.free_port
        monkeypatch.setattr(launch, "free_port", lambda: next(draws, None) or real())
        metrics = FreePort()
        began = time.monotonic()
        with running_pair(tiny_model, tmp_path, tokenizer_extra=["--metrics-port", metrics]) as pair:
            assert metrics.number not in (0, port)
            assert f"metrics on port {metrics.number}" in pair.tokenizer.log_path.read_text()
    assert "Address already in use" in (tmp_path / "tokenizer.attempt1.log").read_text(), "the failed attempt's log"
    assert time.monotonic() - began < 120


def test_a_port_taken_before_a_lone_service_binds_it_starts_that_service_again(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`launch.started`, one service (the tests' own tokenizers beside the
    shared pair), draws its `FreePort`s again at each attempt as
    `running_pair` does."""
    from tests.support.services import FreePort, ServiceProcess, started_tokenizer

    def bound(tok: ServiceProcess) -> None:
        tok.wait_bound(120)  # (no scheduler: never SERVING)

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        draws = iter([port])  # the metrics port's first draw
        real = launch.free_port
        monkeypatch.setattr(launch, "free_port", lambda: next(draws, None) or real())
        metrics, log = FreePort(), tmp_path / "tokenizer.log"
        tok = started_tokenizer(tiny_model, "127.0.0.1:9", log, extra=["--metrics-port", metrics], ready=bound)
        try:
            assert metrics.number not in (0, port)
            assert wait_until(lambda: f"metrics on port {metrics.number}" in log.read_text(), timeout=60)
        finally:
            tok.stop()
    assert "Address already in use" in (tmp_path / "tokenizer.attempt1.log").read_text(), "the failed attempt's log"


def test_a_tokenizer_without_its_scheduler_says_so_over_http(tiny_model: Path, tmp_path: Path) -> None:
    """Before its scheduler answers, the HTTP API's health checks (/health,
    and vLLM's /ping as a load balancer asks) are 503 with Retry-After, and
    a generation is a typed 503 a client retries; /v1/models, which needs
    no scheduler, answers."""
    import openai

    from tests.support.services import FreePort, ServiceProcess, started_tokenizer

    def bound(tok: ServiceProcess) -> None:
        tok.wait_bound(120)  # (no scheduler: never SERVING)

    http, log = FreePort(), tmp_path / "tokenizer.log"
    tok = started_tokenizer(tiny_model, "127.0.0.1:9", log, extra=["--http-port", http], ready=bound)
    try:
        assert wait_until(lambda: "OpenAI-compatible HTTP API on" in log.read_text(), timeout=60)
        base = f"http://127.0.0.1:{http.number}"
        for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")):
            sent = subprocess.run(
                ["curl", "-s", "-i", "-X", method, base + path], capture_output=True, text=True, timeout=30, check=True
            ).stdout
            head, _, body = sent.partition("\n\n")  # (text mode: curl's CRLFs read as newlines)
            assert head.startswith("HTTP/1.1 503"), (path, sent)
            assert "Retry-After: 1" in head, (path, head)
            assert json.loads(body) == {"status": "not ready"}, (path, body)
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list()] == [tiny_model.name]
        with pytest.raises(openai.APIStatusError) as unavailable:
            client.completions.create(model=tiny_model.name, prompt="Hi", max_tokens=2)
        assert unavailable.value.status_code == 503
        assert unavailable.value.body["code"] == "SCHEDULER_UNAVAILABLE"  # type: ignore[index]
        assert unavailable.value.response.headers.get("x-should-retry") == "true"
    finally:
        tok.stop()


# A service whose start-up check of its ports passes, as when another
# process binds the port between the check and the service's own bind.
UNCHECKED = """
import sys
import mmsplit_cli.startup
mmsplit_cli.startup.port_problem = lambda *args: ""
from mmsplit_cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(
    ("service", "extra", "what"),
    [
        ("scheduler", ["--tp", "2", "--port", "0", "--metrics-port"], "metrics"),
        ("tokenizer", ["--scheduler", "127.0.0.1:9", "--http-port", "0", "--port"], "gRPC"),
        ("tokenizer", ["--scheduler", "127.0.0.1:9", "--port", "0", "--http-port"], "HTTP"),
    ],
)
def test_a_port_taken_after_the_check_is_one_line_and_the_service_leaves_at_once(
    service: str, extra: list[str], what: str, chat_models: Callable[[str], Path], tmp_path: Path
) -> None:
    """The race the start-up check cannot close: the bind itself fails. It
    is one line naming the port, exit status 1, and nothing stays: a
    scheduler of two ranks once printed a traceback and then waited for
    ever on its rank 1 as it exited (multiprocessing joins its children;
    the rank waited for rank 0's first plan), and a pair's start that met
    it waited for its 180 s start timeout before trying again. And a
    launcher knows it for a taken port, to start again on another
    (`launch.port_taken`): the HTTP API's line says it in
    asyncio's words, in lower case, which `bench/chaos.py` did not."""
    script = tmp_path / "unchecked.py"
    script.write_text(UNCHECKED)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        args = [service, "--model", str(chat_models("llava")), *extra, port]
        env = {**os.environ, **ENV}
        # A fork of the suite's zygote (its imports spared: this test took
        # 16 s as a new interpreter at TP=2), else a new interpreter.
        proc = forked_script(script, args, env, new_session=True) or subprocess.Popen(
            [sys.executable, str(script), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
            start_new_session=True,
        )
        try:
            done = completed(proc, [str(script), *args], timeout=90)
            # What it started (the tokenizer's CPU pool, a scheduler's rank) leaves with it.
            wait_until(lambda: not _left_in(proc.pid), timeout=10)
        finally:
            left = _left_in(proc.pid)
            for p in left:
                with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                    p.kill()
    stderr = done.stderr
    assert done.returncode == 1, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert (
        stderr.strip().splitlines()[-1].startswith(f"mmsplit {service}: cannot serve {what} on 127.0.0.1:{port}: ")
    ), stderr[-3000:]
    assert stderr.strip().splitlines()[-1].lower().endswith("address already in use"), stderr[-3000:]
    assert launch.port_taken(stderr)
    assert not left, f"processes of the service left: {left}"


def _left_in(session: int) -> list[psutil.Process]:
    """The processes still running (ended and not yet reaped does not
    count) in `session`, but its leader."""
    return [p for p in psutil.process_iter() if p.pid != session and _alive_in(p, session)]


def _alive_in(process: psutil.Process, session: int) -> bool:
    try:
        return os.getsid(process.pid) == session and process.status() != psutil.STATUS_ZOMBIE
    except (OSError, psutil.NoSuchProcess):
        return False
