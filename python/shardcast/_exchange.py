"""Small agreements before the load, through the default group's store, each with the load's timeout.

computed_on_rank0: what rank 0 reads once and every rank uses: the checkpoint's keys, reduced to what a
load needs.

Reading a checkpoint's keys means its index and every file's header: at DeepSeek-V3's 163 files, about
0.3 s of CPU in Python. Only rank 0 does it; the result (the fused-expert compositions, or the shapes of
an explicit mapping's keys) reaches the other ranks through the default group's store, with the load's
timeout. A failure on rank 0 reaches them as "nothing", and rank 0 carries the error into the
handshake, whose verdict raises it on every rank. Without the default store (an explicit process group)
every rank reads for itself, as before.

gathered: every rank's small value (an explicit mapping's boxes) on every rank.
"""
from __future__ import annotations

import datetime
import itertools
import json
from typing import Any, Callable, List

_CALLS = itertools.count()  # every rank loads the same number of times, in the same order
_PREFIX = "shardcast/exchange/"


def _key(n: int, rank: int = 0) -> str:
    return f"{_PREFIX}{n}/{rank}"


def _wait(store, keys, timeout_s: float, what: str) -> None:
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001 -- the store's own timeout or a lost store
        raise TimeoutError(f"{what} did not arrive within {timeout_s:.0f} s ({type(e).__name__}: {e})") from e


def _forget(store, n: int, world: int) -> None:
    """Rank 0 drops exchange n - 2. A load makes at most two exchanges, so n - 2 belongs to an earlier
    load, which every rank read before that load's handshake could end (n - 1 may be this load's)."""
    if n < 2:
        return
    for r in range(world):
        try:
            store.delete_key(_key(n - 2, r))
        except Exception:  # noqa: BLE001 -- a key that was never set, or a store without delete_key
            pass


def computed_on_rank0(store, rank: int, world: int, compute: Callable[[], Any], timeout_s: float) -> Any:
    """compute() on rank 0, its result (JSON: dicts, lists, strings, numbers) on every rank; None on the
    others when compute() raised on rank 0, where it is re-raised after the others were told. A rank that
    hears nothing within timeout_s raises TimeoutError."""
    if world == 1 or store is None:
        return compute()
    n = next(_CALLS)
    key = _key(n)
    if rank == 0:
        _forget(store, n, world)
        try:
            value = compute()
        except BaseException:
            store.set(key, json.dumps(["failed", None]))
            raise
        store.set(key, json.dumps(["ok", value]))
        return value
    _wait(store, [key], timeout_s, "rank 0's reading of the checkpoint's keys")
    status, value = json.loads(store.get(key))
    return value if status == "ok" else None


def gathered(store, pg, rank: int, world: int, value: Any, timeout_s: float) -> List[Any]:
    """Every rank's `value` (JSON), in rank order, on every rank. Through the default store, or the
    group's own all_gather_object where there is none (an explicit process group)."""
    if world == 1:
        return [value]
    if store is None:
        import torch.distributed as dist
        out: List[Any] = [None] * world
        dist.all_gather_object(out, value, group=pg)
        return out
    n = next(_CALLS)
    if rank == 0:
        _forget(store, n, world)
    store.set(_key(n, rank), json.dumps(value))
    keys = [_key(n, r) for r in range(world)]
    _wait(store, keys, timeout_s, "every rank's boxes")
    return [json.loads(store.get(k)) for k in keys]
