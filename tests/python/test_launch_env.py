"""Python reads the launcher's variables through the C++ rendezvous' own parser (runtime/launch_env.cc):
the place from_pretrained and prefetch compute is the one the C++ rendezvous joins, SLURM's list forms
included, and a value neither can read is an InvalidArgument naming the variable, not a silent default."""
import pytest

import shardcast
from shardcast._launch import launch

LAUNCHERS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
             "SLURM_NTASKS_PER_NODE", "SLURM_NODEID", "MASTER_PORT")


@pytest.fixture
def env(monkeypatch):
    for name in LAUNCHERS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_no_launcher_is_a_world_of_one(env):
    assert launch() == ("none", 0, 1, 0, 1)


def test_torchrun(env):
    for name, value in dict(RANK="5", WORLD_SIZE="16", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4").items():
        env.setenv(name, value)
    assert launch() == ("torchrun", 5, 16, 1, 4)


@pytest.mark.parametrize("per_node, node, local_world", [("8", 0, 8), ("8(x2)", 1, 8), ("2(x3),1", 3, 1),
                                                         ("2(x3),1", 2, 2)])
def test_slurm_task_lists_give_this_nodes_count(env, per_node, node, local_world):
    for name, value in dict(SLURM_PROCID="6", SLURM_NTASKS="7", SLURM_LOCALID="0", SLURM_NTASKS_PER_NODE=per_node,
                            SLURM_NODEID=str(node)).items():
        env.setenv(name, value)
    assert launch() == ("slurm", 6, 7, 0, local_world)


@pytest.mark.parametrize("name, value", [("WORLD_SIZE", "four"), ("SLURM_NTASKS_PER_NODE", "8(x")])
def test_a_value_that_cannot_be_read_names_its_variable(env, name, value):
    if name.startswith("SLURM"):
        env.setenv("SLURM_PROCID", "0")
        env.setenv("SLURM_NTASKS", "8")
    else:
        env.setenv("RANK", "0")
    env.setenv(name, value)
    with pytest.raises(shardcast.InvalidArgument, match=name):
        launch()


@pytest.mark.parametrize("given", ["RANK", "WORLD_SIZE"])
def test_half_of_torchruns_pair_is_an_error_not_a_world_of_one(env, given):
    env.setenv(given, "1")
    with pytest.raises(shardcast.InvalidArgument, match=f"{given} is set but"):
        launch()
