"""The one place that reads configuration: command-line flags, each with an
environment fallback, into the services' settings dataclasses.

A field `foo_bar` of a settings class becomes the flag `--foo-bar` (or the
field's `flag` metadata) and reads `MMSPLIT_FOO_BAR` when the flag is absent;
`MMSPLIT_<COMMAND>_FOO_BAR` wins over it, so one environment can configure
both services apart (for example MMSPLIT_SCHEDULER_PORT and
MMSPLIT_TOKENIZER_PORT). Precedence: flag > command variable > shared
variable > default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from mmsplit_server.settings import InvalidSettings

S = TypeVar("S")

PREFIX = "MMSPLIT_"


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r}")


_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
}  # fmt: skip


def _parse_size(text: str) -> int:
    """Bytes: a whole number, or one with a unit (4GiB, 256MiB, 64k, 1.5GB)."""
    raw = text.strip().replace("_", "")
    number = raw.rstrip("bBiIkKmMgG ")
    unit = raw[len(number) :].strip().lower()
    try:
        value = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (bytes, or with a unit: 256MiB, 4GiB, 64k)") from None
    if value != int(value):
        raise argparse.ArgumentTypeError(f"not a whole number of bytes: {text!r}")
    return int(value)


def _parser_for(kind: object, name: str = "") -> Callable[[str], Any]:
    if kind is int and name.endswith("_bytes"):
        return _parse_size
    parsers: dict[object, Callable[[str], Any]] = {bool: _parse_bool, int: int, float: float, Path: Path}
    return parsers.get(kind, str)


def _env_names(command: str, name: str) -> tuple[str, str]:
    return f"{PREFIX}{command.upper()}_{name.upper()}", f"{PREFIX}{name.upper()}"


def add_settings_arguments(parser: argparse.ArgumentParser, cls: type, command: str) -> None:
    """Add one flag per field of the settings dataclass `cls`."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
        own, shared = _env_names(command, f.name)
        kind = hints[f.name]
        required = f.default is dataclasses.MISSING
        default = "(required)" if required else repr(f.default)
        help_text = f"{f.metadata.get('help', '')} [env {own} or {shared}; default {default}]"
        if kind is bool:
            # A switch (--insecure), which also takes a value (--insecure false), as older manifests say it.
            parser.add_argument(
                flag, dest=f.name, type=_parse_bool, nargs="?", const=True, default=None, help=help_text,
                metavar="BOOL",
            )  # fmt: skip
            continue
        parser.add_argument(
            flag, dest=f.name, type=_parser_for(kind, f.name), default=None, help=help_text, metavar=f.name.upper()
        )


def settings_from(args: argparse.Namespace, cls: type[S], command: str, env: Mapping[str, str] | None = None) -> S:
    """Build `cls` from parsed flags, then the environment, then defaults."""
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        value = getattr(args, f.name, None)
        if value is None:
            for name in _env_names(command, f.name):
                if name in env:
                    kind = hints[f.name]
                    raw = env[name]
                    try:
                        value = _parser_for(kind, f.name)(raw)
                    except (ValueError, argparse.ArgumentTypeError) as exc:
                        raise SystemExit(f"mmsplit: {name}={raw!r}: {exc}") from exc
                    break
        if value is None:
            if f.default is dataclasses.MISSING:
                flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
                raise SystemExit(f"mmsplit {command}: {flag} is required (or set {_env_names(command, f.name)[1]})")
            continue
        values[f.name] = value
    try:
        return cls(**values)
    except InvalidSettings as exc:
        raise SystemExit(f"mmsplit {command}: {exc}") from exc
