"""A launcher's temporary directory is removed by the next launcher once
its own is gone, and never while it may run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mmsplit_cli import private_dirs

PREFIX = "mmsplit-serve-"


def _made_by_a_process_that_ends(root: Path) -> Path:
    """A directory made by another process, which has ended (and been reaped)."""
    code = "import sys; from pathlib import Path; from mmsplit_cli import private_dirs; "
    code += "print(private_dirs.make(sys.argv[1], Path(sys.argv[2])))"
    done = subprocess.run(
        [sys.executable, "-c", code, PREFIX, str(root)], capture_output=True, text=True, check=True, timeout=60
    )
    return Path(done.stdout.strip())


def test_the_next_launcher_removes_a_gone_launcher_s_directory_and_keeps_live_ones(tmp_path: Path) -> None:
    gone = _made_by_a_process_that_ends(tmp_path)
    (gone / "scheduler-token").write_text("secret")
    assert gone.is_dir()
    assert gone.name.startswith(PREFIX)
    live = private_dirs.make(PREFIX, tmp_path)  # this process: alive
    assert not gone.exists()
    assert live.stat().st_mode & 0o777 == 0o700
    assert private_dirs.sweep(PREFIX, tmp_path) == []
    assert live.is_dir()


def test_a_pid_used_again_or_another_namespace_or_no_owner_file_is_left(tmp_path: Path) -> None:
    mine = (Path(f"/proc/{os.getpid()}/stat").read_text(), os.stat(f"/proc/{os.getpid()}/ns/pid").st_ino)
    start = mine[0][mine[0].rindex(")") + 2 :].split()[19]
    cases = {
        "reused": f"{os.getpid()} {int(start) + 1} {mine[1]}",  # this pid, another start: the launcher is gone
        "elsewhere": f"999999999 1 {mine[1] + 1}",  # another pid namespace: not judged here
        "unowned": None,
        "other-kind": f"999999999 1 {mine[1]}",
    }
    made = {}
    for name, owner in cases.items():
        path = tmp_path / (("mmsplit-demo-" if name == "other-kind" else PREFIX) + name)
        path.mkdir()
        if owner is not None:
            (path / private_dirs.OWNER_FILE).write_text(owner)
        made[name] = path
    assert private_dirs.sweep(PREFIX, tmp_path) == [made["reused"]]
    assert all(made[name].is_dir() for name in ("elsewhere", "unowned", "other-kind"))
    assert private_dirs.sweep("mmsplit-demo-", tmp_path) == [made["other-kind"]]
