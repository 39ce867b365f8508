"""The contract: buf lint, format and breaking against the committed baseline
image, and the committed generated Python is what the generator makes now."""

from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUF = shutil.which("buf", path=str(Path(sys.executable).parent)) or "buf"


def buf(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([BUF, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_buf_lint() -> None:
    result = buf("lint", "protos")
    assert result.returncode == 0, result.stdout + result.stderr


def test_buf_format() -> None:
    result = buf("format", "--diff", "--exit-code", "protos")
    assert result.returncode == 0, result.stdout + result.stderr


def test_buf_breaking_against_baseline() -> None:
    result = buf("breaking", "protos", "--against", "protos/baseline.binpb")
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from gen_protos import generate
    finally:
        sys.path.pop(0)
    generated = generate(tmp_path)
    assert generated
    stale = [str(p) for p in generated if not filecmp.cmp(tmp_path / p, ROOT / p, shallow=False)]
    assert not stale, f"regenerate with `make proto`: {stale}"
