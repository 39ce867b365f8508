from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from mmsplit_cli.config import add_settings_arguments, settings_from
from mmsplit_server.settings import InvalidSettings, ServiceSettings
from scheduler_svc.settings import SchedulerSettings
from tokenizer_svc.settings import TokenizerSettings


def parse(cls: type, command: str, argv: list[str], env: dict[str, str]):  # type: ignore[no-untyped-def]
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, cls, command)
    return settings_from(parser.parse_args(argv), cls, command, env=env)


def test_flag_beats_command_env_beats_shared_env_beats_default() -> None:
    env = {"MMSPLIT_PORT": "1", "MMSPLIT_SCHEDULER_PORT": "2", "MMSPLIT_MODEL_DIR": "/m"}
    assert parse(SchedulerSettings, "scheduler", ["--port", "3"], env).port == 3
    assert parse(SchedulerSettings, "scheduler", [], env).port == 2
    assert parse(TokenizerSettings, "tokenizer", [], env).port == 1
    assert parse(TokenizerSettings, "tokenizer", [], {"MMSPLIT_MODEL_DIR": "/m"}).port == 50052  # the default
    assert parse(SchedulerSettings, "scheduler", [], env).model_dir == Path("/m")


def test_types_and_required() -> None:
    s = parse(TokenizerSettings, "tokenizer", ["--model", "/m", "--allow-private-fetch", "yes"], {})
    assert s.allow_private_fetch is True
    assert (
        parse(
            TokenizerSettings, "tokenizer", ["--model", "/m"], {"MMSPLIT_ALLOW_PRIVATE_FETCH": "0"}
        ).allow_private_fetch
        is False
    )
    with pytest.raises(SystemExit):
        parse(TokenizerSettings, "tokenizer", [], {})
    with pytest.raises(SystemExit):
        parse(TokenizerSettings, "tokenizer", ["--model", "/m"], {"MMSPLIT_TOKENIZER_PORT": "x"})


@pytest.mark.parametrize(
    ("cls", "command", "argv", "says"),
    [
        (SchedulerSettings, "scheduler", ["--max-running", "0"], "--max-running must be at least 1 (got 0)"),
        (SchedulerSettings, "scheduler", ["--tp", "-2"], "--tp must be at least 1"),
        (SchedulerSettings, "scheduler", ["--launch", "pods"], "--launch must be one of local, env"),
        (SchedulerSettings, "scheduler", ["--dtype", "int8"], "--dtype must be one of auto, float32"),
        (SchedulerSettings, "scheduler", ["--heartbeat-s", "0"], "--heartbeat-s must be at least 0.01"),
        (
            SchedulerSettings,
            "scheduler",
            ["--default-max-tokens", "500", "--max-tokens-limit", "100"],
            "--default-max-tokens (500) is over --max-tokens-limit (100)",
        ),
        (TokenizerSettings, "tokenizer", ["--cpu-workers", "0"], "--cpu-workers must be at least 1"),
        (TokenizerSettings, "tokenizer", ["--max-inflight", "0"], "--max-inflight must be at least 1"),
        (TokenizerSettings, "tokenizer", ["--shm-prefix", "bad/prefix"], "--shm-prefix: invalid shared-memory prefix"),
        (TokenizerSettings, "tokenizer", ["--keepalive-s", "0.5"], "--keepalive-s must be 0 (off) or at least 1"),
        (SchedulerSettings, "scheduler", ["--keepalive-s", "0.5"], "--keepalive-s must be 0 (off) or at least 1"),
        (
            SchedulerSettings,
            "scheduler",
            ["--port", "7000", "--metrics-port", "7000"],
            "--port and --metrics-port are both 7000 on 127.0.0.1: give each its own port",
        ),
        (
            TokenizerSettings,
            "tokenizer",
            ["--port", "8000"],  # --http-port's default
            "--port and --http-port are both 8000 on 127.0.0.1: give each its own port",
        ),
        (TokenizerSettings, "tokenizer", ["--scheduler", "localhost"], "--scheduler 'localhost' is not HOST:PORT"),
        (
            TokenizerSettings,
            "tokenizer",
            ["--scheduler", "127.0.0.1:50051,http://10.0.0.2:50051"],
            "--scheduler 'http://10.0.0.2:50051' is not HOST:PORT (no scheme;",
        ),
        (TokenizerSettings, "tokenizer", ["--scheduler", "dns:///sched"], "--scheduler 'sched' is not HOST:PORT"),
        (
            TokenizerSettings,
            "tokenizer",
            ["--cors-allow-origins", "https://ok.example, chat.example.com"],
            "--cors-allow-origins: 'chat.example.com' is not an origin (scheme://host[:port], or *)",
        ),
        (
            TokenizerSettings,
            "tokenizer",
            ["--health-port", "9000", "--metrics-port", "9000"],
            "--health-port and --metrics-port are both 9000 on 127.0.0.1",
        ),
    ],
)
def test_settings_out_of_range_stop_the_service_with_a_clear_message(
    cls: type, command: str, argv: list[str], says: str
) -> None:
    with pytest.raises(SystemExit) as info:
        parse(cls, command, ["--model", "/m", *argv], {})
    assert str(info.value).startswith(f"mmsplit {command}: ")
    assert says in str(info.value)


def test_scheduler_addresses_as_written_in_the_manifests_are_taken() -> None:
    for setting in ("127.0.0.1:50051", "[::1]:50051", "mmsplit-scheduler:50051,10.0.0.2:50051,",
                    "dns:///mmsplit-scheduler:50051"):  # fmt: skip
        assert parse(TokenizerSettings, "tokenizer", ["--model", "/m", "--scheduler", setting], {}).scheduler == setting


def test_one_port_on_two_addresses_is_no_clash() -> None:
    settings = parse(
        TokenizerSettings, "tokenizer", ["--model", "/m", "--metrics-port", "9000", "--health-port", "9000",
                                         "--metrics-host", "10.0.0.1"], {},
    )  # fmt: skip
    assert (settings.metrics_port, settings.health_port) == (9000, 9000)


def test_every_problem_is_listed_at_once() -> None:
    with pytest.raises(SystemExit) as info:
        parse(SchedulerSettings, "scheduler", ["--model", "/m", "--tp", "0", "--max-queue", "0"], {})
    assert "--tp" in str(info.value)
    assert "--max-queue" in str(info.value)


@pytest.mark.parametrize("cls", [TokenizerSettings, SchedulerSettings])
def test_both_services_share_one_settings_base(cls: type) -> None:
    """What both services take is declared once (`ServiceSettings`): each
    shared setting has the same flag, type and checks in both, and the
    base's cross-field checks run in each service's own."""
    assert issubclass(cls, ServiceSettings)
    ours = {f.name: f for f in dataclasses.fields(cls)}
    for base_field in dataclasses.fields(ServiceSettings):
        f = ours[base_field.name]
        assert f.type == base_field.type, f.name
        assert f.metadata.get("flag") == base_field.metadata.get("flag"), f.name
        assert f.metadata.get("choices") == base_field.metadata.get("choices"), f.name
    with pytest.raises(InvalidSettings) as err:
        cls(model_dir=Path("/m"), tls_cert="c.pem", shm_prefix="bad/prefix", keepalive_s=0.001)
    message = str(err.value)
    assert "--tls-cert and --tls-key go together" in message
    assert "--shm-prefix" in message
    assert "--keepalive-s" in message
