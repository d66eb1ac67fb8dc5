"""Small agreements before the load, through the store of the load's group, each with the load's timeout.

computed_on_rank0: what rank 0 reads once and every rank uses: the checkpoint's keys, reduced to what a
load needs.

Reading a checkpoint's keys means its index and every file's header: at DeepSeek-V3's 163 files, about
0.3 s of CPU in Python. Only rank 0 does it; the result (the fused-expert compositions, or the shapes of
an explicit mapping's keys) reaches the other ranks through the group's store, with the load's
timeout. A failure on rank 0 reaches them as "nothing", and rank 0 carries the error into the
handshake, whose verdict raises it on every rank.

gathered: every rank's small value (an explicit mapping's boxes, every rank's phase times) on every rank.

(decided, in _decided.py: every rank's small value to rank 0 alone, which decides and tells each rank its
part: about 3 W values through the store, where `gathered` moves W^2.)

Each goes through the store of the group the load runs over (`channel`), numbered per group: every rank of
a group makes the same exchanges in the same order, whatever other groups do. The helpers here (the
numbering, the keys, `_through_store`'s one deadline and its errors) are _decided.py's too.
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
# Then one look more: a process stopped (SIGSTOP) past the grace and resumed finds its deadline passed at
# once, while its store calls, resumed too, end in milliseconds; their outcome is the one to act on.
_LAST_LOOK_S = 0.5


def _left(deadline: float) -> datetime.timedelta:
    """What is left until `deadline` (time.monotonic()), as a store wait's timeout."""
    return datetime.timedelta(seconds=max(0.001, deadline - time.monotonic()))


def channel(pg, store):
    """(store, name, who serves the store, this load's state) for the exchanges of a load over `pg`, whose own
    store is `store` (the default store for the default group; c10d keeps one per group). None where
    torch.distributed is not running. Make one per load (from_pretrained: one per step): once its store
    stalled, the load's later exchanges fail at once instead of each waiting out the timeout again. The
    store's addresses are resolved as it is made (once a process: _resolved), for the probe of a late call."""
    if pg is None:
        return None
    import torch.distributed as dist
    from ._group import _store_host
    return store, dist.distributed_c10d._get_process_group_name(pg), _store_host(store), {"numeric": _resolved(store)}


def _next(ch) -> int:
    n = next(_CALLS.setdefault(ch[1], itertools.count()))
    _NEXT[ch[1]] = n + 1
    return n


_NEXT: Dict[str, int] = {}  # per group: the number its next exchange will take
_READ_BY_ALL: Dict[str, int] = {}  # per group: the exchanges before this one were read by every rank


def operation_began(group: str) -> List[str]:
    """An operation (a load, a save) over `group` begins on this rank: the keys of the exchanges every rank
    has read for sure, which rank 0 then drops (the others keep none). Every exchange made before the
    previous operation began was read by every rank before that operation's handshake, a collective this
    rank then ended with all of them. (computed_on_rank0 waits for no rank, so nothing else drops its
    keys: a plain load's names of fused experts, ~1 MB at Qwen3-30B-A3B's scale, stayed in the store for
    every load of a long-lived process.)"""
    read = _READ_BY_ALL.get(group)
    _READ_BY_ALL[group] = _NEXT.get(group, 0)
    return [] if read is None else _forgotten(group, read)


def _key(n: int, rank: Union[int, str] = 0) -> str:
    return f"{_PREFIX}{n}/{rank}"


# The store's server refuses any one value over 8 MiB in a request ("Invalid payload size") and resets the
# connection, which reads as the store lost (and breaks that client for the process): rank 0's reading of
# 80,000 tensors' headers was 9.4 MB. A larger value than _PART_BYTES goes in parts under "<key>/<i>", set
# before the key, which then holds "#<count>" (no JSON value begins with "#"). Replies have no such limit.
_PART_BYTES = 4 << 20


def _split(key: str, text: str) -> Tuple[bytes, List[str]]:
    """(text's bytes, the keys of its parts: none where it fits one value), for _put; a caller that drops
    `key` keeps the parts' keys first, so that a _put that fails midway leaves none it does not know."""
    data = text.encode()
    if len(data) <= _PART_BYTES:
        return data, []
    return data, [f"{key}/{i}" for i in range((len(data) + _PART_BYTES - 1) // _PART_BYTES)]


def _put(store, key: str, data: bytes, parts: List[str]) -> None:
    """Sets `key` to data (_split's), in its parts where it has some: read back whole by _whole."""
    if parts:
        store.multi_set(parts, [data[i * _PART_BYTES:(i + 1) * _PART_BYTES] for i in range(len(parts))])
        data = f"#{len(parts)}".encode()
    store.set(key, data)


def _whole(store, key: str, value: bytes) -> bytes:
    """`value`, read from `key`, whole: its parts read where _put split it."""
    if not value.startswith(b"#"):
        return value
    return b"".join(store.multi_get([f"{key}/{i}" for i in range(int(value[1:]))]))


def _got(store, key: str) -> bytes:
    """What _put set under `key`, whole (the key is there: waited for)."""
    return _whole(store, key, store.get(key))


def _suffixes(n: int, parts: List[str]) -> List[str]:
    """The parts' keys of exchange n as _key's suffixes, for _keep."""
    return [part[len(_key(n, "")):] for part in parts]


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
    from ._shardcast import CommTimeout
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
                missing.extend(_absent(ch[0], *who) or [])
            outcome.append(e)

    waiter = threading.Thread(target=run, name="shardcast-store-wait", daemon=True)
    waiter.start()
    waiter.join(timeout_s + _GRACE_S)
    if waiter.is_alive():
        waiter.join(_LAST_LOOK_S)
    if waiter.is_alive() and _refuses(ch):  # its server is gone: what a rank whose socket saw the close says
        raise _lost(what, ch)
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
        raise _late(what, missing, timeout_s, ch) from e  # c10d's own words (its keys, its wait) chained only
    raise _lost(what, ch) from e  # a lost store (DistNetworkError: its server is gone)


def _lost(what: str, ch):
    """The CommError of a store whose server is gone, the same words on every rank whatever its own socket saw
    (reset, closed, refused: in the chained exception), as runtime/comm/store_channel.h's StoreLost words it."""
    from ._shardcast import CommError
    lost = CommError(f"{what}: the store of {ch[2]} is lost: its connection closed or its port refuses "
                     "connections")
    lost.store_stalled = True  # nothing left to agree through either: raised at once (_carried._agreed)
    return lost


def _resolved(store) -> List[str]:
    """The store's numeric addresses, resolved once as a load's channel is made, while the store answers: a late
    call's probe (_refuses) then asks no name service, whose answer could differ from rank to rank once the
    store's host is gone. [] for a store not served over TCP, or a name not resolved within 1.5 s."""
    from . import _shardcast
    from ._group import _store_address
    host, port = _store_address(store)
    return _shardcast.store_resolve(host, port) if host else []


def _refuses(ch) -> bool:
    """Whether the channel's store's port refuses a connection (its server's process is gone), for a call that
    got no answer in time: a rank whose call was already waiting when the server died, or came after, would
    else call it stalled where a rank whose socket saw the close calls it lost. False for a store not served
    over TCP. On the addresses channel() resolved (its state's "numeric"), else on the name's."""
    from . import _shardcast
    from ._group import _store_address
    host, port = _store_address(ch[0])
    return bool(host) and _shardcast.store_refuses(host, port, ch[3].get("numeric") or [])


def _absent(store, key: str, world: int) -> Optional[List[int]]:
    """The ranks missing from `key`, where each rank that came appended "<rank> "; None when it cannot say."""
    try:
        came = {int(r) for r in store.get(key).decode().split()} if store.check([key]) else set()
    except Exception:  # noqa: BLE001 -- a store that stopped answering, or a rank's word it cannot read
        return None
    return [r for r in range(world) if r not in came]


def _ranks_text(ranks: Sequence[int]) -> str:
    """'rank 2', 'ranks 2, 5', 'ranks 0, 1, ... (12 ranks)'."""
    shown = ", ".join(str(r) for r in ranks[:8]) + (f", ... ({len(ranks)} ranks)" if len(ranks) > 8 else "")
    return ("rank " if len(ranks) == 1 else "ranks ") + shown


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# Per group, on rank 0: the keys of each exchange not dropped yet ({n: key suffixes}), for `_forget`.
_KEPT: Dict[str, Dict[int, List[Union[int, str]]]] = {}


def _keep(ch, n: int, suffixes) -> None:
    """Rank 0 notes keys of exchange n, which a later exchange's `_forget` drops."""
    _KEPT.setdefault(ch[1], {}).setdefault(n, []).extend(suffixes)


def _forget(store, group: str, n: int) -> None:
    """Rank 0 drops every exchange before n that it still keeps, once every rank set its key of n (in
    `gathered` and `decided`, after the wait for them): a rank sets its key of n only after it ended every
    exchange before n, having read all it reads of them. `computed_on_rank0` waits for no rank, so it drops
    nothing (a mapping's load makes one, then a `gathered`, with no handshake between them)."""
    for key in _forgotten(group, n):
        try:
            store.delete_key(key)
        except Exception:  # noqa: BLE001 -- a key that was never set, or a store without delete_key
            pass


def _forgotten(group: str, n: int) -> List[str]:
    """The keys rank 0 keeps of every exchange of `group` before n, no longer kept."""
    kept = _KEPT.get(group, {})
    return [_key(m, suffix) for m in sorted(m for m in kept if m < n) for suffix in kept.pop(m)]


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
        _keep(ch, n, [0])
        try:
            value = compute()
        except BaseException:
            _through_store(ch, lambda store: store.set(key, json.dumps(["failed", None])), timeout_s, what)
            raise
        data, parts = _split(key, json.dumps(["ok", value]))
        _keep(ch, n, _suffixes(n, parts))
        _through_store(ch, lambda store: _put(store, key, data, parts), timeout_s, what)
        return value

    deadline = time.monotonic() + timeout_s

    def fetch(store):
        store.wait([key], _left(deadline))
        return json.loads(_got(store, key))

    status, value = _through_store(ch, fetch, timeout_s, what)
    return value if status == "ok" else None


def gathered(ch, rank: int, world: int, value: Any, timeout_s: float, what: str = "every rank's boxes") -> List[Any]:
    """Every rank's `value` (JSON), in rank order, on every rank, or the same CommTimeout on every rank.

    Each rank sets its value, waits for all W keys in one request and reads them in one (`multi_get`): 5
    requests a rank, where reading each key was W + 3 (a million at 1,024 ranks, on the one store server:
    bench/bench_exchange.py). No rank relays the others' values, so none sets a value W times its own (the
    store refuses one over 8 MiB).

    The ranks' deadlines differ (each counts from its own arrival), so a rank's wait can end while a later
    one still sees every value come. The outcome is therefore one key, set once (`compare_set`) by the first
    rank whose wait ended: "ok" where it read every value, else "timed out" with the ranks that never came
    and that rank's timeout, so every rank's words are the same.
    A rank that read every value after another settled a timeout raises that timeout; one whose wait ended
    after another settled "ok" reads the values and returns them; the rank that settles a timeout sets
    the absent ranks' keys (never read then), so the ranks still waiting raise it at once. No rank returns
    while another raises, but where a store stalled past the grace on some ranks (`_through_store`: rank 0,
    which serves it, stopped; the others raise "stalled") and then came back."""
    if world == 1 or ch is None:
        return [value]
    import torch.distributed as dist
    n = _next(ch)
    keys = [_key(n, r) for r in range(world)]
    outcome_key, who_key = _key(n, "="), _key(n, "who")
    deadline = time.monotonic() + timeout_s

    if rank == 0:
        _keep(ch, n, [*range(world), "who", "="])

    def settle(store, outcome: list) -> list:
        return json.loads(store.compare_set(outcome_key, "", json.dumps(outcome)))

    mine, parts = _split(keys[rank], json.dumps(value))

    def exchange(store):
        _put(store, keys[rank], mine, parts)
        _came(store, n, rank)
        try:
            store.wait(keys, _left(deadline))
        except (TimeoutError, dist.DistStoreError):
            return None  # this rank's deadline passed: settled below, in calls of their own
        return _values(store, ch, n, rank, keys), settle(store, ["ok"])

    def timed_out(store):
        """The outcome some rank set first (with the values where it is "ok"), else this rank's own. It
        waits for no rank: a store that does not answer within the timeout has stalled."""
        # Who came, read before the values: a rank sets its value before it says it came, so a value
        # missing below is a rank missing here, and a timeout always names the ranks it waited for.
        absent = _absent(store, who_key, world)
        if store.check(keys):  # the last came as this rank's wait ended
            settled = settle(store, ["ok"])
        else:
            settled = settle(store, ["timeout", absent or [], timeout_s])
        if settled[0] == "ok":
            return _values(store, ch, n, rank, keys), settled
        if settled[1]:  # the ranks still waiting for the absent ones' values wake now and read the outcome
            store.multi_set([keys[r] for r in settled[1]], ["null"] * len(settled[1]))
        return None, settled

    got = _through_store(ch, exchange, timeout_s, what)
    every, settled = got if got is not None else _through_store(ch, timed_out, timeout_s, what)
    if settled[0] != "ok":  # the timeout of the rank that settled it: the same words on every rank
        raise _late(what, settled[1], settled[2], ch)
    if rank == 0:  # every rank came: what they read before is theirs no longer
        _dropped(ch, n, timeout_s, what)
    return every


def _values(store, ch, n: int, rank: int, keys: List[str]) -> List[Any]:
    """Every rank's value of exchange n (JSON), whole (a rank's over _PART_BYTES is in parts: rank 0 keeps
    their keys, which it alone drops)."""
    every = []
    for key, value in zip(keys, store.multi_get(keys)):
        if rank == 0 and value.startswith(b"#"):
            _keep(ch, n, _suffixes(n, [f"{key}/{i}" for i in range(int(value[1:]))]))
        every.append(json.loads(_whole(store, key, value)))
    return every


def _dropped(ch, n: int, timeout_s: float, what: str) -> None:
    """Rank 0's `_forget` of the exchanges before n, once the exchange itself succeeded: housekeeping,
    never this rank's outcome alone (a store that stalls here is found by the next exchange)."""
    try:
        _through_store(ch, lambda store: _forget(store, ch[1], n), timeout_s, what)
    except Exception:  # noqa: BLE001
        pass


def _late(what: str, absent: List[int], timeout_s: float, ch):
    """The CommTimeout of an exchange whose keys did not arrive in time, naming the ranks that never came
    (its `absent_ranks`, which the group's vote acts on at once: python/operation.h). The same words on every
    rank that saw the same ranks missing: nothing of the rank's own store call (which key it waited on)."""
    from ._shardcast import CommTimeout
    late = f" from {_ranks_text(absent)} (died, frozen, or not in the same shardcast operation)" if absent else ""
    timeout = CommTimeout(f"{what} did not arrive{late} within {timeout_s:g} s through the store of {ch[2]}")
    timeout.absent_ranks = list(absent)
    return timeout


def _came(store, n: int, rank: int) -> None:
    """Says this rank came to exchange n, for the error when someone does not; a store that cannot append
    only says less."""
    try:
        store.append(_key(n, "who"), f"{rank} ")
    except Exception:  # noqa: BLE001
        pass
