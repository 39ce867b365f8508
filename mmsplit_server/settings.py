"""How the services declare their settings: one dataclass field per setting,
its help, and the range or choices it must lie in, checked when the settings
object is made (so a bad value stops the service at startup with a clear
message, never later as a wedged or spinning server)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, TypeVar

from mmsplit.keepalive import MIN_PING_INTERVAL_MS
from mmsplit_server.shm import check_prefix

T = TypeVar("T")


class InvalidSettings(ValueError):
    """One or more settings are outside what they accept; the message lists each."""


def opt(default: T, help: str, *, min: float | None = None, choices: Iterable[str] | None = None) -> T:
    """A setting with a default. `min` is the smallest value accepted (for
    numbers); `choices` the values accepted (for strings)."""
    metadata: dict[str, Any] = {"help": help}
    if min is not None:
        metadata["min"] = min
    if choices is not None:
        metadata["choices"] = tuple(choices)
    result: T = dataclasses.field(default=default, metadata=metadata)
    return result


def flag_of(f: dataclasses.Field[Any]) -> str:
    flag: str = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
    return flag


def check(settings: Any, *extra: str) -> None:
    """Raise InvalidSettings listing every field outside its range or
    choices, and the `extra` problems the caller found across fields."""
    problems = []
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if "min" in f.metadata and value < f.metadata["min"]:
            problems.append(f"{flag_of(f)} must be at least {f.metadata['min']:g} (got {value})")
        if "choices" in f.metadata and value not in f.metadata["choices"]:
            problems.append(f"{flag_of(f)} must be one of {', '.join(f.metadata['choices'])} (got {value!r})")
    problems.extend(extra)
    if problems:
        raise InvalidSettings("; ".join(problems))


def keepalive_problems(keepalive_s: float) -> list[str]:
    """`--keepalive-s` pings no more often than our servers accept (`mmsplit.keepalive`)."""
    least = MIN_PING_INTERVAL_MS / 1000
    if 0 < keepalive_s < least:
        return [f"--keepalive-s must be 0 (off) or at least {least:g}, not {keepalive_s:g}"]
    return []


def prefix_problems(prefix: str) -> list[str]:
    """`--shm-prefix` must be a prefix `mmsplit_server.shm` accepts."""
    try:
        check_prefix(prefix)
    except ValueError as exc:
        return [f"--shm-prefix: {exc}"]
    return []
