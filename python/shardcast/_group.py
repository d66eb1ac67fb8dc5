"""The process group a load or save runs over: its rank, size, CPU backend (a Gloo twin for an NCCL-only
group, made once per group and released with it) and the default store."""
from __future__ import annotations

import os
from typing import Dict, Tuple

import torch

from ._shardcast import InvalidArgument

# Gloo twins of groups that have no CPU backend (NCCL-only), by the group's name: {name: (group, twin)}.
_GLOO_TWINS: Dict[str, Tuple[object, object]] = {}
_TWIN_TIMEOUT_S = 600  # shardcast's default collective timeout: how long a twin's members wait for each other


def _release_gloo_twins(dist) -> None:
    """Shuts down the twins of groups destroyed since (gone from c10d's registry, or their name now taken by
    a group made after a re-init)."""
    registry = dist.distributed_c10d._world.pg_map
    for name, (pg, twin) in list(_GLOO_TWINS.items()):
        if pg not in registry:
            del _GLOO_TWINS[name]
            twin.shutdown()


def _cpu_backend(dist, pg):
    """The group's CPU backend; for a group without one (NCCL-only), its Gloo twin: a ProcessGroupGloo made
    once per group by the group's own ranks alone, over the group's own store. It is not a c10d group
    (new_group is collective over the whole world, and even its local form moves the member ranks' group
    counter out of step with the others'), so no rank outside the group takes part, and every rank's
    later new_group calls stay in step. Shut down once the group is destroyed."""
    try:
        return pg._get_backend(torch.device("cpu"))
    except Exception:  # noqa: BLE001 -- c10d raises RuntimeError or ValueError, by version
        pass
    import datetime
    name = dist.distributed_c10d._get_process_group_name(pg)
    entry = _GLOO_TWINS.get(name)
    if entry is None or entry[0] is not pg:
        store = dist.PrefixStore("shardcast-gloo-twin", dist.distributed_c10d._world.pg_map[pg][1])
        twin = dist.ProcessGroupGloo(store, dist.get_rank(pg), dist.get_world_size(pg),
                                     datetime.timedelta(seconds=_TWIN_TIMEOUT_S))
        entry = _GLOO_TWINS[name] = (pg, twin)
    return entry[1]


def _group(process_group):
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        _GLOO_TWINS.clear()  # destroy_process_group() took them with every other group
        if process_group is not None:
            raise InvalidArgument("process_group given but torch.distributed is not initialized")
        return None, 0, 1, None, None
    _release_gloo_twins(dist)
    pg = process_group if process_group is not None else dist.distributed_c10d._get_default_group()
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    backend = _cpu_backend(dist, pg)
    store = dist.distributed_c10d._get_default_store() if process_group is None else None
    return pg, rank, world, backend, store


def _store_host(store) -> str:
    """Who serves the default group's store, for the message every rank raises if it stops answering."""
    base = store
    while base is not None and hasattr(base, "underlying_store"):  # PrefixStore
        base = base.underlying_store
    host, port = getattr(base, "host", None), getattr(base, "port", None)
    where = f" at {host}:{port}" if host else ""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return f"the torchrun agent's store{where}"
    return f"rank 0 (the store host{where})"
