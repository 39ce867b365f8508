"""Out of file descriptors: every slice and segment a service holds keeps a
descriptor open (its lock lives on it), and some container runtimes start
processes with a soft limit of 1024. Both services raise the limit at start,
and a process that still runs out answers OVERLOADED (retriable, the
server's condition): never INVALID_REQUEST, as if the sender had named
something that is not a segment. And clients cannot take them all: each
serving port keeps at most --max-connections open (a quarter of the limit
by default)."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest

from mmsplit_server.handoff import ranges, slab
from mmsplit_server.serving import Health, new_server
from tests.support import limits
from tests.support.granting import grant_table
from tests.support.leaks import PROJECT_PREFIX, own_slab
from tests.support.services import ROOT

PREFIX = PROJECT_PREFIX + "fds"

# Run in a child: the soft limit lowered, every descriptor used up, then each
# path that opens a segment is tried and what it raised is printed.
CHILD = r"""
import json, os, resource, sys
from mmsplit.common.v1 import common_pb2
from mmsplit.errors import MmsplitError, reason_of
from mmsplit_server.handoff import files, grants
from mmsplit_server.handoff.reference import TensorSpec
from scheduler_svc.reader import SharedMemoryReader
from tokenizer_svc.preprocess import ItemTensor, SlabRef, place

arg = json.loads(sys.argv[1])
piece = files.Slice(arg["segment"], arg["offset"], arg["nbytes"])
grant = grants.Grant(arg["table"], arg["index"], bytes.fromhex(arg["tag"]))
spec = TensorSpec(common_pb2.DTYPE_FLOAT32, (arg["nbytes"] // 4,), shm=piece, grant=grant)
reader = SharedMemoryReader(rank=1, prefix=arg["prefix"], max_bytes=1 << 30)
tensor = ItemTensor("pixel_values", "float32", (arg["nbytes"] // 4,), arg["nbytes"])
data = memoryview(bytes(arg["nbytes"]))
ref = SlabRef(arg["segment"], 1 << 20, 0.0)
attempts = {
    "rank 0 takes a slice at admission": lambda: spec.take(arg["prefix"]),
    "a rank lends a slice": lambda: reader.read("r", spec),
    "a worker writes into the slab": lambda: place(tensor, data, ref, arg["prefix"], os.getpid()),
    "a worker writes a segment of its own": lambda: place(tensor, data, None, arg["prefix"], os.getpid()),
}
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
spent = []
try:
    while True:
        spent.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
out = {}
for what, attempt in attempts.items():
    try:
        attempt()
        out[what] = "no error"
    except MmsplitError as exc:
        out[what] = reason_of(exc.error_code)
    except Exception as exc:
        out[what] = type(exc).__name__
for fd in spent:
    os.close(fd)
print(json.dumps(out))
"""


@pytest.fixture
def owned() -> Iterator[ranges.Slab]:
    with own_slab(PREFIX, 4 << 20) as s:
        yield s


def test_out_of_descriptors_is_overloaded_on_every_path(owned: ranges.Slab) -> None:
    data = np.arange(1024, dtype=np.float32)
    held = slab.place(owned.name, PREFIX, memoryview(data), wait_s=0)  # type: ignore[arg-type]
    try:
        with grant_table(PREFIX) as table:
            grant = table.issue(owned.name, held.slice.offset, data.nbytes)
            arg = {"segment": owned.name, "offset": held.slice.offset, "nbytes": data.nbytes, "prefix": PREFIX}
            arg |= {"table": grant.table, "index": grant.index, "tag": grant.tag.hex()}
            done = subprocess.run(
                [sys.executable, "-c", CHILD, json.dumps(arg)], capture_output=True, text=True, timeout=120, cwd=ROOT
            )
    finally:
        held.close()
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {
        "rank 0 takes a slice at admission": "OVERLOADED",
        "a rank lends a slice": "OVERLOADED",
        "a worker writes into the slab": "OVERLOADED",
        "a worker writes a segment of its own": "OVERLOADED",
    }
    assert owned.used_bytes() == 0


def test_a_service_raises_its_open_file_limit() -> None:
    if limits.nothing_to_raise():
        pytest.skip(limits.nothing_to_raise())
    script = (
        "import resource\nfrom mmsplit_server.serving import raise_fd_limit\n"
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({limits.LOW}, {limits.HARD}))  # as a runtime may start it\n"
        "print(raise_fd_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [str(limits.RAISED), str(limits.RAISED)]


def test_the_automatic_connection_limit_is_a_quarter_of_the_open_file_limit() -> None:
    """`--max-connections 0`: a quarter of the limit as the service runs
    with it (read after it raised its own), at most 10,000; a value given
    wins."""
    code = (
        "import resource, sys\n"
        "from pathlib import Path\n"
        "from mmsplit_server.settings import ServiceSettings\n"
        "soft = int(sys.argv[1])\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (soft, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
        "print(ServiceSettings(model_dir=Path('.')).connection_limit,"
        " ServiceSettings(model_dir=Path('.'), max_connections=7).connection_limit)\n"
    )
    for soft, expected in ((1024, "256 7"), (20000, "5000 7"), (40, "16 7")):
        done = subprocess.run([sys.executable, "-c", code, str(soft)], capture_output=True, text=True, cwd=ROOT)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split() == expected.split(), (soft, done.stdout)


def test_a_server_closes_connections_past_its_limit_unread() -> None:
    """What `new_server(max_connections=N)` asks of gRPC core, held: with 3
    connections open, the next ones are closed before a byte is sent (an
    accepted one gets the server's HTTP/2 settings at once)."""

    async def run() -> list[int]:
        health = Health("t.T")
        await health.start()
        server, port = await new_server(
            host="127.0.0.1",
            port=0,
            health_=health,
            service_names=["t.T"],
            max_message_bytes=1 << 20,
            max_connections=3,
        )
        await server.start()
        held: list[socket.socket] = []
        got: list[int] = []
        try:
            for _ in range(6):
                conn = await asyncio.to_thread(socket.create_connection, ("127.0.0.1", port), 10)
                held.append(conn)
                got.append(len(await asyncio.to_thread(conn.recv, 9)))
        finally:
            for conn in held:
                conn.close()
            await server.stop(None)
        return got

    assert asyncio.run(run()) == [9, 9, 9, 0, 0, 0]
