"""Where ranks meet. `--launch env` under a LeaderWorkerSet: torch's
rendezvous variables come from LWS's when they are not set, and never
override what is set. A local group: rank 0's store port is bound from the
moment it is chosen."""

from __future__ import annotations

import errno
import socket

import pytest

from scheduler_svc.rendezvous import (
    adopt_leaderworkerset_env,
    close_listeners,
    env_problem,
    local_rendezvous,
    take_listener,
)

LWS = {"LWS_WORKER_INDEX": "3", "LWS_GROUP_SIZE": "4", "LWS_LEADER_ADDRESS": "leader.mmsplit"}


def test_lws_variables_fill_in_torch_s() -> None:
    env = dict(LWS)
    adopt_leaderworkerset_env(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"], env["MASTER_PORT"]) == (
        "3",
        "4",
        "leader.mmsplit",
        "29500",
    )


def test_what_is_set_wins() -> None:
    env = {**LWS, "RANK": "1", "MASTER_PORT": "4000"}
    adopt_leaderworkerset_env(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]) == ("1", "4", "4000")


def test_without_a_leaderworkerset_nothing_changes() -> None:
    env = {"RANK": "0"}
    adopt_leaderworkerset_env(env)
    assert env == {"RANK": "0"}


def test_what_env_launch_lacks_is_said_before_anything_loads() -> None:
    assert env_problem({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "leader", "MASTER_PORT": "29500"}) == ""
    said = env_problem({"RANK": "0", "MASTER_ADDR": "leader"})
    assert said.startswith("--launch env joins its group by torch's env:// rendezvous: WORLD_SIZE, MASTER_PORT not set")
    assert "RANK 2" in env_problem({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}).replace(
        "'", ""
    )
    assert "MASTER_PORT 'x' is not a port number" in env_problem(
        {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "x"}
    )
    # Under a LeaderWorkerSet its own variables stand for torch's, the port 29500 unless set.
    env = dict(LWS)
    adopt_leaderworkerset_env(env)
    assert env_problem(env) == ""


def test_a_local_group_s_port_is_held_from_the_moment_it_is_chosen() -> None:
    """No other process can bind the store's port between its choice and the
    store's start (a port found free and bound later could be taken, and
    the group would not form); the store takes the listening socket once."""
    first, second = local_rendezvous(2), local_rendezvous(1)
    try:
        assert (first.addr, first.rank, first.world_size) == ("127.0.0.1", 0, 2)
        assert first.port != second.port
        for reuse in (0, 1):  # SO_REUSEADDR does not get past a listening socket
            with socket.socket() as other:
                other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, reuse)
                with pytest.raises(OSError, match="in use") as refused:
                    other.bind(("127.0.0.1", first.port))
                assert refused.value.errno == errno.EADDRINUSE
        with socket.create_connection(("127.0.0.1", first.port), timeout=5):
            pass  # a rank that connects before the store starts waits in the backlog
        listener = take_listener(first)
        assert listener is not None
        assert listener.getsockname() == ("127.0.0.1", first.port)
        assert take_listener(first) is None
        listener.close()
    finally:
        close_listeners()  # what a forked rank does: rank 0's sockets closed
    assert take_listener(second) is None
    with socket.socket() as again:
        again.bind(("127.0.0.1", second.port))  # closed: the port is free again
