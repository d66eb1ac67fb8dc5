"""decided: every rank's small value to rank 0 alone, which decides from them and tells each rank only its
part of the answer (whether every rank can stream, and its node's part: _stream_rules.agree, _stream.py's
check of the built model): about 3 W values through the store, where `_exchange.gathered` moves W^2.

Through the store of the load's group (`_exchange.channel`), numbered with the group's other exchanges.
"""
from __future__ import annotations

import json
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from ._exchange import (_absent, _came, _dropped, _first_line, _keep, _key, _late, _left, _next, _put, _split,
                        _through_store, _values)


def decided(ch, rank: int, world: int, value: Any, decide: Callable[[List[Any]], Dict[str, Any]], timeout_s: float,
            what: str, part: str = "") -> Tuple[Any, Any]:
    """(the common answer, this rank's `part` of it) that rank 0 decides from every rank's `value` (JSON):
    decide(every value in rank order) -> {"": common answer, part name: answer, ...} on rank 0 only. A
    rank asks for the part it knows itself by (its node, say); None where decide gave no such part.

    Each rank sets its value; rank 0 waits for all W in one request, reads them in one (`multi_get`),
    decides, sets the parts in one request (`multi_set`) and then the outcome; every other rank waits for
    the outcome and reads it and its part. So rank 0 reads W values and every other rank two: about
    3 W values through the store, where `gathered` makes every rank read all W (W^2: at 1,024 ranks a
    million, through the store's one server).

    The outcome is one key, set once (`compare_set`): rank 0's answer, or, from the first rank whose wait
    ends at the deadline, "timed out" with the ranks that never came (none came late: rank 0, which did not
    answer). Every rank acts on the one that got there first, so no rank returns while another raises, and
    every rank raises the same CommTimeout naming the same ranks. decide failing on rank 0 (or giving
    what JSON cannot carry) is an InternalError on every rank; interrupted there (KeyboardInterrupt,
    SystemExit), it is an InternalError on every other rank at once and the interrupt on rank 0."""
    from ._shardcast import InternalError
    if world == 1 or ch is None:
        try:
            answers = json.loads(json.dumps(decide([value])))  # what the ranks of a larger world would read
            return answers[""], answers.get(part)
        except Exception as e:  # noqa: BLE001 -- as on rank 0 of a larger world
            raise InternalError(f"{what}: rank 0 could not decide ({type(e).__name__}: {_first_line(e)})") from e
    import torch.distributed as dist
    n = _next(ch)
    # "=": the outcome, set once; "=!": set by whoever set or read it, which every store server wakes its
    # waiters on (the non-libuv TCPStore server wakes none on compare_set).
    outcome_key, told_key, who_key = _key(n, "="), _key(n, "=!"), _key(n, "who")
    deadline = time.monotonic() + timeout_s

    def settle(store, outcome: str) -> list:
        """The outcome every rank acts on: `outcome` where no rank set one before, else that one."""
        settled = json.loads(store.compare_set(outcome_key, "", outcome))
        store.add(told_key, 1)
        return settled

    def read(store, settled: list):
        """(the outcome, this rank's part where it is "ok" and rank 0 set one: the parts are set before it)."""
        part_key = _key(n, "=" + part)
        if settled[0] != "ok" or part == "" or not store.check([part_key]):
            return settled, None
        return settled, json.loads(store.get(part_key))

    def timed_out(late: List[int]):
        """After this rank's wait ended at the deadline: the outcome some rank set first (rank 0's answer,
        where it came in the meantime), in calls of their own. They wait for no rank: a store that does not
        answer them within the timeout has stalled."""
        def body(store):
            absent = _absent(store, who_key, world)
            return read(store, settle(store, json.dumps(["timeout", late if absent == [] else absent or [],
                                                          timeout_s])))
        return _through_store(ch, body, timeout_s, what)

    mine, mine_parts = _split(_key(n, rank), json.dumps(value))

    def gather(store):  # rank 0
        _put(store, _key(n, 0), mine, mine_parts)
        _came(store, n, 0)
        keys = [_key(n, r) for r in range(world)]
        try:
            store.wait(keys, _left(deadline))
        except (TimeoutError, dist.DistStoreError):
            return None, "timeout"
        return _values(store, ch, n, 0, keys), None

    def tell(store, parts: Dict[str, str], outcome: str):  # rank 0
        if parts:
            store.multi_set([_key(n, "=" + name) for name in parts], list(parts.values()))
        return settle(store, outcome)  # after the parts: a rank that reads it finds its part there

    def wait(store):  # every other rank
        _put(store, _key(n, rank), mine, mine_parts)
        _came(store, n, rank)
        try:
            store.wait([told_key], _left(deadline))
        except (TimeoutError, dist.DistStoreError):
            return "timeout", None
        return read(store, json.loads(store.get(outcome_key)))

    failure: Optional[BaseException] = None
    own: Any = None
    if rank == 0:
        _keep(ch, n, [*range(world), "who", "=", "=!"])
        every, settled = _through_store(ch, gather, timeout_s, what)
        if settled == "timeout":
            settled, own = timed_out([])
        else:
            parts: Dict[str, str] = {}
            try:
                answers = decide(every)
                outcome = json.dumps(["ok", answers[""]])
                parts = {name: json.dumps(answer) for name, answer in answers.items() if name != ""}
            except BaseException as e:  # noqa: BLE001 -- told to every rank, then raised here (from it)
                failure, parts = e, {}
                outcome = json.dumps(["failed", f"{type(e).__name__}: {_first_line(e)}"])
            _keep(ch, n, ["=" + name for name in parts])
            # waits for no rank: a store that does not answer within the timeout has stalled
            settled = _through_store(ch, lambda store: tell(store, parts, outcome), timeout_s, what)
            _dropped(ch, n, timeout_s, what)  # the others go on meanwhile
            if failure is not None and not isinstance(failure, Exception):
                raise failure  # an interrupt or an exit stays what it is on rank 0, whatever the others heard
            if settled[0] == "ok" and part in parts:
                own = json.loads(parts[part])
    else:
        settled, own = _through_store(ch, wait, timeout_s, what)
        if settled == "timeout":
            settled, own = timed_out([0])
    if settled[0] == "ok":
        return settled[1], (settled[1] if part == "" else own)
    if settled[0] == "failed":
        raise InternalError(f"{what}: rank 0 could not decide ({settled[1]})") from failure
    raise _late(what, settled[1], settled[2], ch)
