"""Where this process sits in its job, from its launcher's variables, before any process group exists:
torchrun (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) or SLURM's srun (SLURM_PROCID, SLURM_NTASKS,
SLURM_LOCALID, SLURM_NTASKS_PER_NODE), as the C++ rendezvous reads them (RendezvousFromEnvironment)."""
from __future__ import annotations

import os
import re
from typing import NamedTuple


class Launch(NamedTuple):
    launcher: str     # "torchrun", "slurm", or "none"
    rank: int
    world: int
    local_rank: int
    local_world: int


def _int(env, name: str, default: int) -> int:
    text = env.get(name)
    if text is None:
        return default
    m = re.match(r"\s*(\d+)", text)  # SLURM_NTASKS_PER_NODE may read "8(x2)"
    return int(m.group(1)) if m else default


def launch(env=None) -> Launch:
    env = os.environ if env is None else env
    if "WORLD_SIZE" in env:
        world = _int(env, "WORLD_SIZE", 1)
        rank = _int(env, "RANK", 0)
        return Launch("torchrun", rank, world, _int(env, "LOCAL_RANK", rank), _int(env, "LOCAL_WORLD_SIZE", world))
    if "SLURM_NTASKS" in env and "SLURM_PROCID" in env:
        world = _int(env, "SLURM_NTASKS", 1)
        return Launch("slurm", _int(env, "SLURM_PROCID", 0), world, _int(env, "SLURM_LOCALID", 0),
                      _int(env, "SLURM_NTASKS_PER_NODE", world))
    return Launch("none", 0, 1, 0, 1)
