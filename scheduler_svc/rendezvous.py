"""Where and as whom a rank joins its group: a locally launched one's
`Rendezvous`, and for `--launch env` the variables torch's env://
rendezvous reads (a LeaderWorkerSet's adopted for them, and what is
missing said before anything loads). A module of its own, light (no
torch): imported by the rank launcher (`group`: a spawned rank imports it
before anything heavy), the CLI's start-up checks, the collective that
joins the group and the rank bootstrap, none of which import each other
for it."""

from __future__ import annotations

import socket
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Rendezvous:
    """Where and as whom a locally launched rank joins its group."""

    addr: str
    port: int
    rank: int
    world_size: int


# Rank 0's listening sockets for its local group's store, by port: bound
# when the port is chosen and handed to the store (`take_listener`).
_listeners: dict[int, socket.socket] = {}


def local_rendezvous(world_size: int, addr: str = "127.0.0.1") -> Rendezvous:
    """Rank 0's rendezvous for a group on this host, on a port the kernel
    picks and that is bound and listening from now on: no other process can
    take it in the seconds before the store starts (a port chosen free and
    bound later could be, and the group would not form). The ranks that
    connect early wait in the socket's backlog."""
    listener = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET)
    try:
        listener.bind((addr, 0))
        listener.listen(max(64, world_size))
    except OSError:
        listener.close()
        raise
    port = int(listener.getsockname()[1])
    _listeners[port] = listener
    return Rendezvous(addr, port, 0, world_size)


def take_listener(rendezvous: Rendezvous) -> socket.socket | None:
    """The socket `local_rendezvous` bound for `rendezvous` (None if it did
    not, or it was taken already)."""
    return _listeners.pop(rendezvous.port, None)


def close_listeners() -> None:
    """In a rank forked from rank 0: close rank 0's listening sockets (the
    rank would otherwise keep the store's port open after rank 0 is gone)."""
    while _listeners:
        _listeners.popitem()[1].close()


# LeaderWorkerSet names a pod's place in its group with its own variables.
LWS_ENV = {"RANK": "LWS_WORKER_INDEX", "WORLD_SIZE": "LWS_GROUP_SIZE", "MASTER_ADDR": "LWS_LEADER_ADDRESS"}
DEFAULT_MASTER_PORT = "29500"


def adopt_leaderworkerset_env(env: MutableMapping[str, str]) -> None:
    """For `--launch env` under a LeaderWorkerSet: torch's variables that are
    not set are taken from LWS's (RANK from LWS_WORKER_INDEX, WORLD_SIZE from
    LWS_GROUP_SIZE, MASTER_ADDR from LWS_LEADER_ADDRESS; MASTER_PORT 29500
    unless set), so a pod spec needs no shell to translate them."""
    if "LWS_WORKER_INDEX" not in env:
        return
    for torch_name, lws_name in LWS_ENV.items():
        if torch_name not in env and lws_name in env:
            env[torch_name] = env[lws_name]
    env.setdefault("MASTER_PORT", DEFAULT_MASTER_PORT)


ENV_RENDEZVOUS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def env_problem(env: Mapping[str, str]) -> str:
    """What keeps `--launch env` from joining its group through torch's
    env:// rendezvous ("" when nothing does), given the environment after
    `adopt_leaderworkerset_env`: a variable unset, or not a number where
    one is wanted."""
    missing = [name for name in ENV_RENDEZVOUS if not env.get(name)]
    if missing:
        return (
            f"--launch env joins its group by torch's env:// rendezvous: {', '.join(missing)} not set (set RANK, "
            "WORLD_SIZE, MASTER_ADDR and MASTER_PORT, or run under a LeaderWorkerSet, whose LWS_WORKER_INDEX, "
            "LWS_GROUP_SIZE and LWS_LEADER_ADDRESS stand for the first three)"
        )
    rank, world, port = env["RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]
    if not (rank.isdigit() and world.isdigit() and int(rank) < int(world)):
        return f"--launch env: RANK {rank!r} and WORLD_SIZE {world!r} must be whole numbers, RANK below WORLD_SIZE"
    if not (port.isdigit() and 0 < int(port) < 65536):
        return f"--launch env: MASTER_PORT {port!r} is not a port number"
    return ""
