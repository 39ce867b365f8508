"""The two distributions as people install them: the light client wheel
alone in a fresh virtual environment (no torch, transformers, numpy, pillow
or av; its few dependencies from the local wheel cache `make dev` fills),
talking to services started from the server wheel in another environment;
and the version numbers of both released in lockstep."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

import mmsplit
from tests.support.serve_output import serving
from tests.support.services import ENV, ROOT

pytestmark = pytest.mark.e2e
CLIENT_WHEELS = ROOT / ".venv" / "client-wheels"
HEAVY = ("torch", "transformers", "numpy", "pillow", "av", "accelerate", "aiohttp")


def _pyproject(path: Path) -> dict:
    return tomllib.loads(path.read_text())["project"]


def test_the_two_distributions_are_released_in_lockstep() -> None:
    server, client = _pyproject(ROOT / "pyproject.toml"), _pyproject(ROOT / "client" / "pyproject.toml")
    assert server["version"] == client["version"] == mmsplit.__version__
    assert f"mmsplit-client=={client['version']}" in server["dependencies"]
    # The client depends on gRPC and protobuf alone, and only the server on the heavy stack.
    assert {d.split(">")[0].split("=")[0] for d in client["dependencies"]} == {
        "grpcio",
        "grpcio-status",
        "protobuf",
        "googleapis-common-protos",
    }


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kwargs)
    assert result.returncode == 0, f"{cmd}: {result.stdout[-2000:]}{result.stderr[-3000:]}"
    return result


def _env() -> dict[str, str]:
    """The environment of a program run from an installed venv: no path
    into this checkout."""
    env = {**os.environ, **ENV}
    env.pop("PYTHONPATH", None)
    return env


def _venv(where: Path) -> Path:
    """A fresh venv without pip (this venv's pip installs into it)."""
    _run([sys.executable, "-m", "venv", "--without-pip", str(where)])
    return where / "bin" / "python"


def _pip_into(python: Path, *args: str) -> None:
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", *args])


def _installed(python: Path) -> dict[str, str]:
    out = _run(
        [str(python), "-c", "import importlib.metadata as m, json; "
         "print(json.dumps({d.metadata['Name'].lower(): d.version for d in m.distributions()}))"],
        env=_env(), cwd="/",
    )  # fmt: skip
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Both wheels, built as `make dist` builds them, from a copy of the
    sources (setuptools writes build/ and *.egg-info where it builds)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("client", "mmsplit", "mmsplit_server", "mmsplit_cli", "tokenizer_svc", "scheduler_svc"):
        shutil.copytree(ROOT / name, src / name, ignore=skip)  # the .proto links become files
    _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
          "--wheel-dir", str(out), "./client", "."], cwd=src)  # fmt: skip
    built = {p.name.split("-")[0]: p for p in out.glob("*.whl")}
    assert set(built) == {"mmsplit", "mmsplit_client"}, built
    return built


@pytest.fixture
def client_venv(tmp_path: Path, wheels: dict[str, Path]) -> Path:
    assert CLIENT_WHEELS.is_dir(), "run `make dev` (it fills .venv/client-wheels)"
    python = _venv(tmp_path / "client-venv")
    _pip_into(python, "--no-index", "--find-links", str(CLIENT_WHEELS), str(wheels["mmsplit_client"]))
    return python


@pytest.fixture
def served(tmp_path: Path, wheels: dict[str, Path], tiny_model: Path) -> Iterator[str]:
    """`mmsplit serve` from the server wheel: a venv holding the two wheels
    (the heavy dependencies are this venv's, reached through a path file,
    since installing torch again would take minutes) whose requirements are
    all met there. Yields the tokenizer's address."""
    python = _venv(tmp_path / "server-venv")
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    # A path line, not a site directory: this venv's editable installs of the
    # checkout (its .pth files) stay out.
    (site / "zz-runtime.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _pip_into(python, "--no-deps", "--no-index", str(wheels["mmsplit"]), str(wheels["mmsplit_client"]))
    check = (
        "import importlib.metadata as m, mmsplit, mmsplit_cli\n"
        "from packaging.requirements import Requirement\n"
        "assert mmsplit_cli.__file__.startswith(__import__('sys').prefix), mmsplit_cli.__file__\n"
        "unmet = [r for r in map(Requirement, m.requires('mmsplit')) if not r.marker and "
        "m.version(r.name) not in r.specifier]\n"
        "assert not unmet, unmet\n"
    )
    _run([str(python), "-c", check], env=_env(), cwd="/")
    proc = subprocess.Popen(
        [str(python.parent / "mmsplit"), "serve", "--model", str(tiny_model), "--port", "0", "--http-port", "0"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env=_env(), cwd=tmp_path,
    )  # fmt: skip
    with serving(proc) as out:
        yield out.grpc_address


def test_the_client_wheel_alone_talks_to_services_from_the_server_wheel(client_venv: Path, served: str) -> None:
    installed = _installed(client_venv)
    assert "mmsplit-client" in installed
    assert not [name for name in (*HEAVY, "mmsplit") if name in installed], installed
    script = (
        "import json, sys\n"
        "from mmsplit.client import Client, RequestFailed\n"
        f"with Client({served!r}) as client:\n"
        "    done = client.complete('Say something.', max_tokens=4)\n"
        "    try:\n"
        "        client.complete('Say something.', max_tokens=4, temperature=float('nan'))\n"
        "        refused = ''\n"
        "    except RequestFailed as exc:\n"
        "        refused = exc.reason\n"
        "import mmsplit\n"
        "print(json.dumps({'tokens': done.completion_tokens, 'finish': done.finish_reason, 'refused': refused,\n"
        "                  'file': mmsplit.__file__, 'modules': sorted({m.split('.')[0] for m in sys.modules})}))\n"
    )
    got = json.loads(_run([str(client_venv), "-c", script], env=_env(), cwd="/").stdout)
    assert got["tokens"] >= 1, got
    assert got["finish"], got
    assert got["refused"] == "INVALID_REQUEST", got
    assert got["file"].startswith(str(client_venv.parent.parent)), got["file"]
    assert not {"torch", "transformers", "numpy", "PIL", "av", "mmsplit_server"} & set(got["modules"])
    # The .proto sources travel with the stubs.
    protos = _run([str(client_venv), "-c", "import importlib.resources as r; "
                   "print(r.files('mmsplit.tokenizer.v1').joinpath('tokenizer.proto').read_text())"],
                  env=_env(), cwd="/").stdout  # fmt: skip
    assert protos.strip() == (ROOT / "protos/mmsplit/tokenizer/v1/tokenizer.proto").read_text().strip()


def test_the_conformance_extra_brings_the_kit_s_command(client_venv: Path) -> None:
    kit = client_venv.parent / "mmsplit-conformance"
    missing = subprocess.run([str(kit), "--help"], capture_output=True, text=True, env=_env(), cwd="/", timeout=60)
    assert missing.returncode != 0, missing.stderr[-2000:]
    assert "pip install 'mmsplit-client[conformance]'" in missing.stderr.splitlines()[-1], missing.stderr[-2000:]
    _pip_into(client_venv, "--no-index", "--find-links", str(CLIENT_WHEELS), "mmsplit-client[conformance]")
    helped = _run([str(kit), "--help"], env=_env(), cwd="/")
    assert "--tokenizer" in helped.stdout
    assert not [name for name in HEAVY if name in _installed(client_venv)]
