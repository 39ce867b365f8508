"""The inline transport: a tensor's bytes in the message itself, for a
scheduler that shares no memory with its tokenizer (another pod, another
host). Nothing to hold and nothing to release: the bytes live as long as the
message that carries them."""

from __future__ import annotations


def place(data: memoryview) -> bytes:
    """The bytes to carry in the message (one copy out of `data`)."""
    return data.cast("B").tobytes()


def lend(payload: bytes) -> memoryview:
    """The bytes as they arrived, read-only, with no copy."""
    return memoryview(payload).toreadonly()


def read_into(payload: bytes, out: memoryview) -> None:
    """Copy the bytes into `out` (exactly as many)."""
    out.cast("B")[:] = payload
