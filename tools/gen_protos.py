"""Regenerate the committed Python code of the protos (one generator for all).

    python tools/gen_protos.py            # writes next to the package (mmsplit/...)
    python tools/gen_protos.py --out DIR  # writes under DIR (the freshness test)

The output is `*_pb2.py`, `*_pb2.pyi` and `*_pb2_grpc.py` from
`python -m grpc_tools.protoc`, a relative symbolic link to each `.proto` beside
its modules (the client distribution ships the contract's source as package
data; the wheel holds the file itself), and an
empty `__init__.py` in each generated package directory so the generated
modules import as regular packages.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.glob("mmsplit/**/*.proto"))


def generate(out: Path) -> list[Path]:
    """Generate into `out`; return the generated files, relative to `out`."""
    files = proto_files()
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *[str(f.relative_to(PROTO_ROOT)) for f in files],
    ]
    subprocess.run(cmd, check=True, cwd=PROTO_ROOT)
    generated: list[Path] = []
    for f in files:
        rel_dir = f.parent.relative_to(PROTO_ROOT)
        for sub in (rel_dir, *rel_dir.parents):
            if sub == Path("."):
                continue
            init = out / sub / "__init__.py"
            # mmsplit/__init__.py is hand-written; only package dirs below it are ours.
            if sub != Path("mmsplit") and not init.exists():
                init.write_text("")
        stem = f.stem
        link = out / rel_dir / f.name
        link.unlink(missing_ok=True)
        link.symlink_to(os.path.relpath(f, link.parent))
        generated += [
            rel_dir / f.name,
            rel_dir / f"{stem}_pb2.py",
            rel_dir / f"{stem}_pb2.pyi",
            rel_dir / f"{stem}_pb2_grpc.py",
        ]
    return generated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: the repository)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for path in generate(args.out):
        print(path)


if __name__ == "__main__":
    main()
