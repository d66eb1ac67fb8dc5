"""The process group a load or save runs over: its rank and size, and the store of one operation.

Each load or save runs over a Gloo group of its own (made in C++ by the group's ranks over the
operation's store, runtime/comm/c10d_communicator.h: CreateGlooCommunicatorOnStore), never over the
caller's backends. So a rank that fails mid-stream aborts that group, and its peers blocked on it fail
at once instead of waiting out the timeout; the caller's groups (NCCL-only ones included) are never
touched and stay usable after a failure; and no c10d group is registered, so every rank's later
new_group calls stay in step. The operation's store is a prefix of the group's own store, numbered per
group (every rank of a group makes the same shardcast calls in the same order, as for collectives): each
operation's failure note and Gloo rendezvous keys are its own, so a failure is never reported again by
a later operation. An operation that ends well leaves its Gloo group for the next one over the same group
(C++ KeepGlooGroup): where every rank still holds it, agreed over the next operation's store, that one
skips the rendezvous and the teardown; an operation that fails takes its group with it."""
from __future__ import annotations

import itertools
import os
from typing import Dict, Tuple

from ._shardcast import InvalidArgument

_OPERATIONS: Dict[str, "itertools.count[int]"] = {}  # per group name: the number of its next operation


def _group(process_group):
    """(pg, rank, world, store): store is the group's own (the default store for the default group); pg
    and store are None where torch.distributed is not running (a world of one)."""
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        if _OPERATIONS:  # a later init_process_group starts every group afresh
            _OPERATIONS.clear()
            from ._shardcast import forget_gloo_groups
            forget_gloo_groups()
        if process_group is not None:
            raise InvalidArgument("process_group given but torch.distributed is not initialized")
        return None, 0, 1, None
    c10d = dist.distributed_c10d
    pg = process_group if process_group is not None else c10d._get_default_group()
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    if rank < 0:
        raise InvalidArgument(f"this process (global rank {dist.get_rank()}) is not a member of process_group")
    store = c10d._get_default_store() if process_group is None else c10d._world.pg_map[pg][1]
    return pg, rank, world, store


def operation_store(pg, store):
    """The store of this rank's next load or save over `pg`: its own prefix of the group's store. None for a
    world of one."""
    if pg is None:
        return None
    import torch.distributed as dist
    from ._exchange import operation_began
    name = dist.distributed_c10d._get_process_group_name(pg)
    n = next(_OPERATIONS.setdefault(name, itertools.count()))
    read = operation_began(name)  # every rank notes where its exchanges stand; rank 0 alone keeps keys
    if dist.get_rank(pg) == 0 and (read or n >= 2):
        _bounded(lambda: _drop(store, read, n - 2))
    return dist.PrefixStore(f"shardcast/op/{n}", store)


_DROP_WAIT_S = 5.0


def _bounded(fn) -> None:
    """fn() on a thread of its own, waited for at most _DROP_WAIT_S: a store that stopped answering (its
    server frozen) never returns a delete, and the operation then names it under its own deadline."""
    import threading
    t = threading.Thread(target=fn, name="shardcast-store-drop", daemon=True)
    t.start()
    t.join(_DROP_WAIT_S)


# What an operation leaves under its prefix: the agreement on its Gloo group (runtime/comm/gloo_groups.cc),
# who came to its agreement collectives, and on a failure the note, its acknowledgements and who arrived
# (runtime/comm/store_channel.cc, c10d_backend.cc). (Gloo's
# own rendezvous keys, where a group was made, are gloo's names and stay.)
_OPERATION_KEYS = ("group/decision", "group/who", "group/token", "group/differ", "group/arrived",
                   "shardcast/failure", "shardcast/failure_acks", "shardcast/reached/ready",
                   "shardcast/reached/collectives", "shardcast/reached/failing")


def _drop(store, exchanges, n: int) -> None:
    """Rank 0 drops the exchanges' keys every rank has read (_exchange.operation_began), and operation n's
    keys as operation n + 2 begins: it ended operation n + 1 with every rank, each of which had ended
    operation n, so none reads them again. (Each operation kept ~6 keys, for every load and save of a
    long-lived process.)"""
    import torch.distributed as dist
    keys = [(store, k) for k in exchanges]
    if n >= 0:
        prefixed = dist.PrefixStore(f"shardcast/op/{n}", store)
        keys += [(prefixed, k) for k in _OPERATION_KEYS]
    for where, key in keys:
        try:
            where.delete_key(key)
        except Exception:  # noqa: BLE001 -- a key never set, or a store without delete_key
            pass


def _store_address(store) -> Tuple[str, int]:
    """Where the group's store listens: a TCPStore's (host, port) under any PrefixStores; ("", -1) for another."""
    base = store
    while base is not None and hasattr(base, "underlying_store"):  # PrefixStore
        base = base.underlying_store
    host, port = getattr(base, "host", None), getattr(base, "port", None)
    return (host, int(port)) if host and isinstance(port, int) else ("", -1)


def _store_host(store) -> str:
    """Who serves the group's store, for the message every rank raises if it stops answering."""
    host, port = _store_address(store)
    where = f" at {host}:{port}" if host else ""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return f"the torchrun agent's store{where}"
    return f"rank 0 (the store host{where})"
