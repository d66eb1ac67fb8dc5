"""Small agreements before the load, through the store of the load's group, each with the load's timeout.

computed_on_rank0: what rank 0 reads once and every rank uses: the checkpoint's keys, reduced to what a
load needs.

Reading a checkpoint's keys means its index and every file's header: at DeepSeek-V3's 163 files, about
0.3 s of CPU in Python. Only rank 0 does it; the result (the fused-expert compositions, or the shapes of
an explicit mapping's keys) reaches the other ranks through the group's store, with the load's
timeout. A failure on rank 0 reaches them as "nothing", and rank 0 carries the error into the
handshake, whose verdict raises it on every rank.

gathered: every rank's small value (an explicit mapping's boxes, whether it can stream) on every rank.

Both go through the store of the group the load runs over (`channel`), numbered per group: every rank of
a group makes the same exchanges in the same order, whatever other groups do.
"""
from __future__ import annotations

import datetime
import itertools
import json
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

_CALLS: Dict[str, "itertools.count[int]"] = {}  # per group: its ranks make the same exchanges, in order
_PREFIX = "shardcast/exchange/"
# Beyond an exchange's timeout, for its store calls before and after the wait (set, append, get), whose
# wait takes only what is left of the timeout: a live store answers them in milliseconds.
_GRACE_S = 3.0


def _left(deadline: float) -> datetime.timedelta:
    """What is left until `deadline` (time.monotonic()), as a store wait's timeout."""
    return datetime.timedelta(seconds=max(0.001, deadline - time.monotonic()))


def channel(pg, store):
    """(store, name, who serves the store, this load's state) for the exchanges of a load over `pg`, whose own
    store is `store` (the default store for the default group; c10d keeps one per group). None where
    torch.distributed is not running. Make one per load: once its store stalled, the load's later
    exchanges fail at once instead of each waiting out the timeout again."""
    if pg is None:
        return None
    import torch.distributed as dist
    from ._group import _store_host
    return store, dist.distributed_c10d._get_process_group_name(pg), _store_host(store), {}


def _next(ch) -> int:
    return next(_CALLS.setdefault(ch[1], itertools.count()))


def _key(n: int, rank: Union[int, str] = 0) -> str:
    return f"{_PREFIX}{n}/{rank}"


def _through_store(ch, body: Callable[[Any], Any], timeout_s: float, what: str,
                   who: Optional[Tuple[str, int]] = None) -> Any:
    """body(store): one exchange's store calls (set, append, wait, get), under one deadline. A CommTimeout
    naming who serves the store when its keys do not arrive within timeout_s (and, with who = (key, world),
    the ranks missing from that key, which every rank that came appended itself to; they are the
    exception's `absent_ranks`), a CommError when the store itself is lost.

    The calls run on a thread of its own and this one gives up at the deadline: a TCPStore whose server is
    frozen (its rank stopped, not dead) never answers, neither a `set` nor the cancel that ends a timed-out
    `wait`, so the store's own timeouts alone would block this rank for ever. The abandoned thread stays
    blocked on that store; the job has lost the rank that serves it anyway, and the load's later exchanges
    fail at once."""
    from ._shardcast import CommError, CommTimeout
    import torch.distributed as dist
    state = ch[3]
    if "stalled" in state:
        stalled = CommTimeout(f"{what}: the store of {ch[2]} stopped answering earlier in this load "
                              f"({state['stalled']})")
        stalled.store_stalled = True
        raise stalled
    outcome: List[BaseException] = []
    result: List[Any] = []
    missing: List[int] = []

    def run() -> None:
        try:
            result.append(body(ch[0]))
        except BaseException as e:  # noqa: BLE001 -- handed to the waiting thread
            if who is not None and isinstance(e, (TimeoutError, dist.DistStoreError)):
                missing.extend(_absent(ch[0], *who))
            outcome.append(e)

    waiter = threading.Thread(target=run, name="shardcast-store-wait", daemon=True)
    waiter.start()
    waiter.join(timeout_s + _GRACE_S)
    if waiter.is_alive():
        state["stalled"] = f"{what} got no answer within {timeout_s:g} s"
        stalled = CommTimeout(f"{what} did not arrive within {timeout_s:g} s through the store of {ch[2]}, and "
                              f"the store does not answer (its server stalled)")
        stalled.store_stalled = True  # nothing left to agree through (_carried._agreed)
        raise stalled
    if not outcome:
        return result[0]
    e = outcome[0]
    if not isinstance(e, (TimeoutError, dist.DistError, ConnectionError, OSError)):
        raise e  # not the store's: the body's own (a value JSON cannot carry, say), as it was raised
    if isinstance(e, (TimeoutError, dist.DistStoreError)):  # the store answered: nobody set the keys in time
        late = f" from {_ranks_text(missing)} (died, frozen, or not in the same shardcast operation)" if missing else ""
        timeout = CommTimeout(f"{what} did not arrive{late} within {timeout_s:g} s through the store of {ch[2]} "
                              f"({type(e).__name__}: {_first_line(e)})")
        timeout.absent_ranks = list(missing)  # the group's vote acts on them at once (binding.cc)
        raise timeout from e
    # a lost store (DistNetworkError: its server is gone)
    raise CommError(f"{what}: the store of {ch[2]} stopped answering ({type(e).__name__}: "
                    f"{_first_line(e)})") from e


def _absent(store, key: str, world: int) -> List[int]:
    """The ranks missing from `key`, where each rank that came appended "<rank> "; none when it cannot say."""
    try:
        came = {int(r) for r in store.get(key).decode().split()} if store.check([key]) else set()
    except Exception:  # noqa: BLE001 -- a store that stopped answering, or a rank's word it cannot read
        return []
    return [r for r in range(world) if r not in came]


def _ranks_text(ranks: Sequence[int]) -> str:
    """'rank 2', 'ranks 2, 5', 'ranks 0, 1, ... (12 ranks)'."""
    shown = ", ".join(str(r) for r in ranks[:8]) + (f", ... ({len(ranks)} ranks)" if len(ranks) > 8 else "")
    return ("rank " if len(ranks) == 1 else "ranks ") + shown


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _forget(store, n: int, world: int) -> None:
    """Rank 0 drops exchange n - 2, which every rank has read by then: rank 0 reaches n only after every
    rank set its key of n - 1 (`gathered`), which a rank does after reading n - 2, or, where n - 1 was
    `computed_on_rank0`, after the load's handshake that follows it, which every rank reaches after
    reading n - 1 and so n - 2. (No two `computed_on_rank0` follow each other without a handshake.)"""
    if n < 2:
        return
    for r in [*range(world), "who"]:
        try:
            store.delete_key(_key(n - 2, r))
        except Exception:  # noqa: BLE001 -- a key that was never set, or a store without delete_key
            pass


def computed_on_rank0(ch, rank: int, world: int, compute: Callable[[], Any], timeout_s: float) -> Any:
    """compute() on rank 0, its result (JSON: dicts, lists, strings, numbers) on every rank; None on the
    others when compute() raised on rank 0, where it is re-raised after the others were told. A rank that
    hears nothing within timeout_s raises CommTimeout naming the store's host."""
    if world == 1 or ch is None:
        return compute()
    n = _next(ch)
    key = _key(n)
    what = "rank 0's reading of the checkpoint's keys"
    if rank == 0:
        _through_store(ch, lambda store: _forget(store, n, world), timeout_s, what)
        try:
            value = compute()
        except BaseException:
            _through_store(ch, lambda store: store.set(key, json.dumps(["failed", None])), timeout_s, what)
            raise
        _through_store(ch, lambda store: store.set(key, json.dumps(["ok", value])), timeout_s, what)
        return value

    deadline = time.monotonic() + timeout_s

    def fetch(store):
        store.wait([key], _left(deadline))
        return json.loads(store.get(key))

    status, value = _through_store(ch, fetch, timeout_s, what)
    return value if status == "ok" else None


def gathered(ch, rank: int, world: int, value: Any, timeout_s: float, what: str = "every rank's boxes") -> List[Any]:
    """Every rank's `value` (JSON), in rank order, on every rank.

    Each rank sets its value, waits for all W keys in one request and reads them in one (`multi_get`): 4
    requests a rank, where reading each key was W + 3 (a million at 1,024 ranks, on the one store server:
    bench/bench_exchange.py). No rank relays the others' values, so none sets a value W times its own (the
    store refuses one over 8 MiB), and a rank that never comes is named by every rank that waited for it."""
    if world == 1 or ch is None:
        return [value]
    n = _next(ch)
    keys = [_key(n, r) for r in range(world)]
    deadline = time.monotonic() + timeout_s

    def exchange(store):
        if rank == 0:
            _forget(store, n, world)
        store.set(_key(n, rank), json.dumps(value))
        try:  # who came, for the error when someone does not; a store that cannot append only says less
            store.append(_key(n, "who"), f"{rank} ")
        except Exception:  # noqa: BLE001
            pass
        store.wait(keys, _left(deadline))
        return [json.loads(v) for v in store.multi_get(keys)]

    return _through_store(ch, exchange, timeout_s, what, who=(_key(n, "who"), world))
