"""`--launch env` under a LeaderWorkerSet: torch's rendezvous variables come
from LWS's when they are not set, and never override what is set."""

from __future__ import annotations

from scheduler_svc.rendezvous import adopt_leaderworkerset_env, env_problem

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
