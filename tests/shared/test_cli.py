"""The CLI as a person types it: mistakes are one message and a non-zero
exit, never a traceback; switches, sizes with units and --version work."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from mmsplit import __version__
from mmsplit_cli.config import add_settings_arguments, settings_from
from mmsplit_cli.main import parser
from scheduler_svc.settings import SchedulerSettings
from tests.support.services import ROOT
from tokenizer_svc.settings import TokenizerSettings


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mmsplit_cli", *argv], capture_output=True, text=True, timeout=120, cwd=ROOT, check=False
    )


def test_version_and_user_mistakes_in_generate(tmp_path: Path) -> None:
    done = run("--version")
    assert (done.returncode, done.stdout.strip()) == (0, f"mmsplit {__version__}")
    cases = {
        ("generate", "--max-tokens", "-5", "hi"): "argument --max-tokens: -5 is negative",
        ("generate", "--top-k", "lots", "hi"): "argument --top-k: 'lots' is not a whole number",
        ("generate", "--logit-bias", "5", "hi"): "argument --logit-bias: '5' is not ID=BIAS",
        ("generate", "--logit-bias", "5=lots", "hi"): "argument --logit-bias: '5=lots' is not ID=BIAS",
        ("generate", "--image", str(tmp_path / "missing.png"), "hi"): f"{tmp_path / 'missing.png'}: No such file",
        ("generate", "--json-schema", f"@{tmp_path / 's.json'}", "hi"): f"{tmp_path / 's.json'}: No such file",
        ("generate",): "give a prompt or a conversation",
        ("generate", "--user", "hi", "a prompt too"): "give a prompt or a conversation",
        ("generate", "--system", "only a system turn"): "needs at least one --user turn",
    }
    for argv, says in cases.items():
        done = run(*argv, "--server", "127.0.0.1:9")
        assert done.returncode == 2, (argv, done.stderr)
        assert says in done.stderr, (argv, done.stderr)
        assert "Traceback" not in done.stderr, (argv, done.stderr)


def test_serve_refuses_one_port_for_both_apis(tmp_path: Path) -> None:
    done = run("serve", "--model", str(tmp_path), "--port", "8100", "--http-port", "8100")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == "mmsplit serve: --port and --http-port are both 8100: give each its own port"


def test_no_server_at_the_address_is_one_line_naming_it_and_what_it_means() -> None:
    nothing = "(nothing listens there: is the service running, and is this its gRPC port?)"
    for argv, code, starts in (
        (("generate", "--server", "127.0.0.1:9", "hi"), 2, "mmsplit generate: 127.0.0.1:9: UNAVAILABLE: "),
        (("info", "--server", "127.0.0.1:9"), 1, "mmsplit info: 127.0.0.1:9: UNAVAILABLE: "),
        # Every check would fail alike: said once, before any.
        (
            ("conformance", "--tokenizer", "127.0.0.1:9"),
            2,
            "mmsplit conformance: --tokenizer 127.0.0.1:9: cannot be reached: ",
        ),
    ):
        done = run(*argv)
        assert done.returncode == code, (argv, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, lines
        assert lines[0].startswith(starts), lines
        assert lines[0].endswith(nothing), lines
    done = run("generate", "--server", "http://127.0.0.1:9", "hi")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().endswith("(give HOST:PORT, without a URL's scheme)"), done.stderr
    done = run("health", "--server", "127.0.0.1:9")
    assert done.returncode == 1
    assert done.stderr.strip() == f"mmsplit health: 127.0.0.1:9: {nothing.strip('()')}", done.stderr


def test_an_http_port_given_for_the_grpc_one_is_named(tmp_path: Path) -> None:
    """The OpenAI API's port given where the gRPC one belongs: gRPC's own
    words ("Failed parsing HTTP/2") and what they mean."""
    import http.server
    import threading

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        done = run("generate", "--server", f"127.0.0.1:{server.server_port}", "hi")
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().endswith(
        "(a server that does not speak gRPC's HTTP/2 answered there, such as the OpenAI API's port: "
        "give the gRPC port, 50052 by default)"
    ), done.stderr


def test_tiny_model_never_writes_over_a_directory_that_holds_something(tmp_path: Path) -> None:
    """Its files (config.json, model.safetensors, the tokenizer's) would
    overwrite a checkpoint's of the same names and leave the rest: a real
    checkpoint given by mistake would be ruined."""
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text('{"model_type": "llava"}')
    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    for target, held in ((checkpoint, "is not empty"), (a_file, "is a file")):
        done = run("tiny-model", str(target))
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith(f"mmsplit tiny-model: {target} {held}: give a new or empty directory"), (
            done.stderr
        )
    assert [p.name for p in checkpoint.iterdir()] == ["config.json"]
    assert (checkpoint / "config.json").read_text() == '{"model_type": "llava"}'
    assert a_file.read_text() == "mine"


def test_tiny_model_writes_again_over_a_tiny_model_it_wrote(tmp_path: Path) -> None:
    """The README's quick start run twice: a directory this command wrote
    (its marker) is written afresh, no file of the earlier model left."""
    from mmsplit_cli.tiny_model import MARKER

    earlier = tmp_path / "tiny"
    earlier.mkdir()
    (earlier / MARKER).write_text("")
    (earlier / "video_preprocessor_config.json").write_text("{}")  # a Qwen model's, not a LLaVA's
    done = run("tiny-model", "--cache-dir", str(ROOT / ".cache"), str(earlier))
    assert done.returncode == 0, done.stderr
    assert not (earlier / "video_preprocessor_config.json").exists()
    assert (earlier / MARKER).is_file()
    assert '"model_type": "llava"' in (earlier / "config.json").read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"], "written beside it, then renamed: nothing else left"


def _settings(cls: type, command: str, *argv: str) -> object:
    p = argparse.ArgumentParser()
    add_settings_arguments(p, cls, command)
    return settings_from(p.parse_args(["--model", "m", *argv]), cls, command, env={})


def test_boolean_settings_are_switches_and_sizes_take_units() -> None:
    assert _settings(SchedulerSettings, "scheduler", "--insecure").insecure is True  # type: ignore[attr-defined]
    assert _settings(SchedulerSettings, "scheduler", "--insecure", "false").insecure is False  # type: ignore[attr-defined]
    tok = _settings(TokenizerSettings, "tokenizer", "--shm-slab-bytes", "256MiB", "--max-image-bytes", "4GiB")
    assert (tok.shm_slab_bytes, tok.max_image_bytes) == (256 * 2**20, 4 * 2**30)  # type: ignore[attr-defined]
    with pytest.raises(SystemExit):
        _settings(TokenizerSettings, "tokenizer", "--shm-slab-bytes", "lots")


def test_conversation_flags_keep_their_order() -> None:
    args = parser().parse_args(["generate", "--system", "s", "--user", "u1", "--assistant", "a", "--user", "u2"])
    assert args.turns == [("system", "s"), ("user", "u1"), ("assistant", "a"), ("user", "u2")]


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({}, {"GOMP_SPINCOUNT": "20000"}),
        ({"OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_WAIT_POLICY": "PASSIVE"}),
        ({"GOMP_SPINCOUNT": "0"}, {"GOMP_SPINCOUNT": "0"}),
    ],
    ids=["default", "a wait policy is kept", "a spin count is kept"],
)
def test_openmp_threads_spin_briefly_unless_the_environment_says(
    given: dict[str, str], expected: dict[str, str]
) -> None:
    """`mmsplit` sets libgomp's spin count before torch is imported, unless
    the environment chose how OpenMP threads wait."""
    from mmsplit_cli.main import openmp_defaults

    env = {"PATH": "/usr/bin", **given}
    openmp_defaults(env)
    assert env == {"PATH": "/usr/bin", **expected}
