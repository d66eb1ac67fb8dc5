"""What rank 0 reads once and every rank receives, with rank 0's error (its class and message) raised on
every rank when it fails: the one exchange DCP's metadata step needs before DCP's own collectives.

DCP calls `read_metadata` on every rank at once (inside its plan step), so rank 0 reads the checkpoint's
headers and the others wait for the result on the group's store with the operation's timeout. A rank
that hears nothing raises CommTimeout naming the store's host, and a lost store CommError; it never waits
for ever, not even on a frozen rank 0 (shardcast._exchange._wait).
"""
from __future__ import annotations

import itertools
import json
from typing import Any, Callable, Dict

from .. import _shardcast
from .._exchange import _wait, channel
from .._group import _group

_CALLS: Dict[str, "itertools.count[int]"] = {}
_PREFIX = "shardcast/dcp/agree/"


def _raise(kind: str, message: str):
    cls = getattr(_shardcast, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, _shardcast.ShardcastError)):
        cls = _shardcast.InternalError
    raise cls(message)


def on_rank0(process_group, compute: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """compute() on rank 0 of `process_group` (the default group when None; this process alone where
    torch.distributed is not running), its JSON result on every rank. When compute() raises on rank 0,
    every rank raises the same ShardcastError subclass with the same message (another exception type
    becomes InternalError naming it)."""
    pg, rank, world, store = _group(process_group)
    if world == 1 or store is None:
        return compute()
    import torch.distributed as dist
    name = dist.distributed_c10d._get_process_group_name(pg)
    n = next(_CALLS.setdefault(name, itertools.count()))
    key = f"{_PREFIX}{n}"
    if rank == 0:
        if n >= 2:  # every rank read exchange n - 2 before it could start exchange n - 1
            try:
                store.delete_key(f"{_PREFIX}{n - 2}")
            except Exception:  # noqa: BLE001 -- a store without delete_key
                pass
        try:
            _shardcast.fault_point("metadata", 0)  # tests only: rank 0 killed or frozen before it answers
            value = compute()
        except _shardcast.ShardcastError as e:
            store.set(key, json.dumps(["failed", type(e).__name__, str(e)]))
            raise
        except Exception as e:  # noqa: BLE001 -- any failure on rank 0 reaches every rank
            message = f"{what} on rank 0: {type(e).__name__}: {e}"
            store.set(key, json.dumps(["failed", "InternalError", message]))
            raise _shardcast.InternalError(message) from e
        store.set(key, json.dumps(["ok", value]))
        return value
    _wait(channel(pg, store), [key], timeout_s, f"rank {rank}: {what} from rank 0")
    reply = json.loads(store.get(key))
    if reply[0] == "ok":
        return reply[1]
    _raise(reply[1], reply[2])
