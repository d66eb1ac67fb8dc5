"""Where this process sits in its job, from its launcher's variables, before any process group exists:
torchrun (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) or SLURM's srun (SLURM_PROCID, SLURM_NTASKS,
SLURM_LOCALID, SLURM_NTASKS_PER_NODE in any of SLURM's list forms, "8(x2)", with SLURM_NODEID). Read by the
C++ rendezvous' own parser (runtime/launch_env.cc), so Python and C++ never disagree about a variable."""
from __future__ import annotations

from typing import NamedTuple

from . import _shardcast


class Launch(NamedTuple):
    launcher: str     # "torchrun", "slurm", or "none"
    rank: int
    world: int
    local_rank: int
    local_world: int


def launch() -> Launch:
    """This process's place; an InvalidArgument naming the variable whose value cannot be read."""
    launcher, rank, world, local_rank, local_world = _shardcast.launch_environment()
    return Launch("none" if launcher == "default" else launcher, rank, world, local_rank, local_world)
