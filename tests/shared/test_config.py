from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from mmsplit_cli.config import add_settings_arguments, settings_from
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
    assert parse(TokenizerSettings, "tokenizer", [], {"MMSPLIT_MODEL_DIR": "/m"}).port == 0
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
