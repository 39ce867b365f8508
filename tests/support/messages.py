"""What clients were told: every error message the tests' clients decoded,
scanned for what must never reach a user — segment names, the host's boot
id, stack text (README, "What users see")."""

from __future__ import annotations

import re
from pathlib import Path

SEGMENT_NAME = re.compile(r"\b[A-Za-z][A-Za-z0-9_]{0,31}-[0-9]{1,10}-[0-9a-f]{16}\b")
STACK_TEXT = re.compile(r"Traceback \(most recent call last\)|File \"[^\"]+\", line \d+")

seen: list[str] = []


def boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def leaks(messages: list[str]) -> list[str]:
    """The messages that show a segment name, the boot id or stack text."""
    host = boot_id()
    return [m for m in messages if SEGMENT_NAME.search(m) or host in m or STACK_TEXT.search(m)]
