"""Things that are not segments, planted under segment names: a directory,
a FIFO, a symlink, and another user's regular file (what anyone who can
write to /dev/shm could leave there)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mmsplit_server.handoff import files


@contextmanager
def planted(prefix: str, workdir: Path, size: int = 64) -> Iterator[dict[str, str]]:
    """kind -> segment name; all removed afterwards."""
    made = {kind: files.new_name(prefix, 4242) for kind in ("directory", "fifo", "symlink", "another user's file")}
    try:
        os.mkdir(files.SHM_DIR / made["directory"])
        os.mkfifo(files.SHM_DIR / made["fifo"], 0o600)
        (workdir / "symlink-target").write_bytes(b"\0" * size)
        os.symlink(workdir / "symlink-target", files.SHM_DIR / made["symlink"])
        foreign = files.SHM_DIR / made["another user's file"]
        foreign.write_bytes(b"\0" * size)
        os.chown(foreign, 4242, 4242)
        yield made
    finally:
        for name in made.values():
            path = files.SHM_DIR / name
            if path.is_dir() and not path.is_symlink():
                path.rmdir()
            else:
                path.unlink(missing_ok=True)
