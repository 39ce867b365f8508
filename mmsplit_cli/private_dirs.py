"""Temporary directories of a launcher (`mmsplit serve`, `mmsplit demo`)
that outlive a launcher killed outright, and are removed by the next one.

A launcher removes its directory as it ends; SIGKILL (the OOM killer, a CI
timeout) leaves it no time. Each directory therefore says whose it is: a
file `launcher` holding the launcher's pid, the start time the kernel gives
that process (so a pid used again by another process is not taken for the
launcher), and its pid namespace (a launcher in another namespace that
shares this temporary directory is never judged from here). A launcher
sweeps, before it makes its own, every directory of its kind owned by its
user whose launcher is gone. A directory without that file (made by an
older version, or by hand) is left alone.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

OWNER_FILE = "launcher"


def make(prefix: str, root: Path | None = None) -> Path:
    """A new directory `<root>/<prefix><random>` (mode 0700) owned by this
    process, after removing those of launchers that are gone."""
    where = Path(root or tempfile.gettempdir())
    sweep(prefix, where)
    made = Path(tempfile.mkdtemp(prefix=prefix, dir=where))
    (made / OWNER_FILE).write_text(_identity(os.getpid()) or "")
    return made


def sweep(prefix: str, root: Path) -> list[Path]:
    """Remove the directories `<root>/<prefix>*` whose launcher is gone;
    returns them."""
    removed = []
    for path in root.glob(f"{prefix}*"):
        try:
            if path.is_symlink() or not path.is_dir() or path.stat().st_uid != os.getuid():
                continue
            owner = (path / OWNER_FILE).read_text().split()
        except OSError:
            continue  # not ours to judge, or going away as we look
        if len(owner) != 3 or not owner[0].isdigit() or _alive(owner):
            continue
        shutil.rmtree(path, ignore_errors=True)
        log.info("removed %s, left by a launcher killed outright (pid %s)", path, owner[0])
        removed.append(path)
    return removed


def _alive(owner: list[str]) -> bool:
    """Whether the launcher `owner` names may still run: it does when the
    pid shows the same start time, and it is not ours to judge when its pid
    namespace is another."""
    pid, _, namespace = owner
    mine = _identity(os.getpid())
    if mine is None or mine.split()[2] != namespace:
        return True
    return _identity(int(pid)) == " ".join(owner)


def _identity(pid: int) -> str | None:
    """`<pid> <start time> <pid namespace>` of a running process, or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        namespace = os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: the
    # start time is the 20th field after its closing one.
    start = stat[stat.rindex(")") + 2 :].split()[19]
    return f"{pid} {start} {namespace}"
