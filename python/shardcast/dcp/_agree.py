"""What rank 0 reads once and every rank receives, with rank 0's error (its class and message) raised on
every rank when it fails: the one exchange DCP's metadata step needs before DCP's own collectives.

DCP calls `read_metadata` on every rank at once (inside its plan step), so rank 0 reads the checkpoint's
headers and the others wait for the result on the group's store with the operation's timeout. A rank
that hears nothing raises CommTimeout naming the store's host, and a lost store CommError; it never waits
for ever, not even on a frozen rank 0 (shardcast._exchange._through_store).

Only calls inside a dcp.load over the group come here, on every rank of it at once: a call outside DCP
(transformers' consolidate_distributed_checkpoint asks rank 0 alone; a script may ask any rank) and a
`dcp.load(..., no_dist=True)` read for themselves (_hf_reader.py), so the exchanges are numbered per group,
with the group's other exchanges (_exchange.py: rank 0 drops each key once every rank read it; a process
that loaded again and again kept every load's headers), and every rank's n-th is rank 0's n-th, whatever path each rank names the checkpoint by (each node's copy
may have its own). A rank given other files than rank 0's is found by read_data's agreement, which matches
every rank's files with rank 0's (their names, sizes, headers and first data bytes); numbered by path, as it
once was, such a rank waited for an answer under its own path until the timeout.
"""
from __future__ import annotations

import functools
import json
import logging
import sys
import time
from typing import Any, Callable, Optional, Tuple

from .. import _shardcast
from .._exchange import _got, _keep, _key, _left, _next, _put, _split, _suffixes, _through_store, channel
from .._group import _group


def _raise(kind: str, message: str):
    cls = getattr(_shardcast, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, _shardcast.ShardcastError)):
        cls = _shardcast.InternalError
    raise cls(message)


def on_rank0(process_group, compute: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """compute() on rank 0 of `process_group` (the default group when None; this process alone where
    torch.distributed is not running), its JSON result on every rank; every rank of the group calls it
    together. When compute() raises on rank 0, every rank raises the same ShardcastError subclass with the
    same message (another exception type becomes InternalError naming it)."""
    pg, rank, world, store = _group(process_group)
    if world == 1 or store is None:
        return compute()
    ch = channel(pg, store)
    n = _next(ch)  # numbered with the group's other exchanges, and dropped with them once every rank read it
    key = _key(n)
    if rank == 0:
        _keep(ch, n, [0])
        error = None
        try:
            _shardcast.fault_point("metadata", 0)  # tests only: rank 0 killed or frozen before it answers
            reply = ["ok", compute()]
        except _shardcast.ShardcastError as e:
            reply, error = ["failed", type(e).__name__, str(e)], e
        except Exception as e:  # noqa: BLE001 -- any failure on rank 0 reaches every rank
            reply = ["failed", "InternalError", f"{what} on rank 0: {type(e).__name__}: {e}"]
            error = _shardcast.InternalError(reply[2])
            error.__cause__ = e
        try:  # under a deadline, as every store call here
            data, parts = _split(key, json.dumps(reply))
            _keep(ch, n, _suffixes(n, parts))
            _through_store(ch, lambda s: _put(s, key, data, parts), timeout_s, f"rank 0: {what}, told to the others")
        except _shardcast.ShardcastError as lost:
            if error is not None:  # rank 0's own failure is the cause; the others hear of it by their timeout
                raise error from lost
            raise
        if error is not None:
            raise error
        return reply[1]
    deadline = time.monotonic() + timeout_s

    def fetch(s):
        s.wait([key], _left(deadline))
        return json.loads(_got(s, key))

    reply = _through_store(ch, fetch, timeout_s, f"rank {rank}: {what} from rank 0")
    if reply[0] == "ok":
        return reply[1]
    _raise(reply[1], reply[2])


def logged(step):
    """A DCP storage step (read_metadata, read_data, write_data) whose CommError or CommTimeout is also logged
    (ERROR on the "shardcast" logger: stderr where logging is not set up) before it is raised. DCP catches a
    step's exception on each rank and then gathers every rank's outcome over its own group; where a peer died,
    that gather fails with Gloo's bare "Connection closed by peer", which DCP raises instead: shardcast's agreed
    error (naming the rank lost and, for a save, whether the previous checkpoint stands) was seen nowhere."""
    @functools.wraps(step)
    def run(*args, **kwargs):
        try:
            return step(*args, **kwargs)
        except (_shardcast.CommError, _shardcast.CommTimeout) as e:
            logging.getLogger("shardcast").error("dcp %s: %s: %s", step.__name__, type(e).__name__, e)
            raise
    return run


def alone(plans: list, process_group) -> bool:
    """Whether DCP's plan step ran on this rank alone while a group of several runs (dcp.save or dcp.load
    with no_dist=True on one rank, use_collectives=False): then the storage layer runs as a world of one.
    Another count of plans than the group's size is a group DCP runs over but the storage layer was not
    given: an InvalidArgument (on every rank: DCP hands the coordinator's error to each)."""
    world = _group(process_group)[2]
    if len(plans) == 1 and world > 1:
        return True
    if len(plans) != world:
        raise _shardcast.InvalidArgument(f"dcp runs over {len(plans)} ranks but shardcast's storage layer over a group of "
                              f"{world}: pass the process_group given to dcp.save/dcp.load to the storage "
                              "reader or writer as well")
    return False


_DCP_STEPS = ("_load_state_dict", "_save_state_dict")  # DCP's functions that run a load or a save on a rank


def dcp_run() -> Optional[Tuple[bool, Any]]:
    """(whether DCP runs over a group, the process_group it was given or None) for the dcp.load or dcp.save
    (also async_save's upload, _load_state_dict_from_keys, ...) that called into the storage layer on this
    thread, read from DCP's own frame (its _DistWrapper, `distW`); None where no DCP step is on the stack (a
    caller of read_metadata on its own, as transformers' consolidation).

    DCP tells a storage reader or writer neither no_dist nor its process_group, and a rank that waits for a
    group the load does not run over waits until the timeout: with no_dist=True on a rank other than 0, or a
    subgroup without rank 0 not also given to the reader."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in _DCP_STEPS and frame.f_globals.get("__name__", "").startswith(
                "torch.distributed.checkpoint."):
            wrapper = frame.f_locals.get("distW")
            if wrapper is not None and hasattr(wrapper, "use_dist"):
                return bool(wrapper.use_dist), getattr(wrapper, "group", None)
        frame = frame.f_back
    return None


def group_problem(given, run_pg) -> Optional[str]:
    """The InvalidArgument's message where a storage layer was given a process_group (`given`; None: not
    told) of other ranks than the group its DCP step runs over (`run_pg`, dcp_run()'s; None: the default
    group); None where they agree. Found on this rank alone, before it waits on either group: a rank that
    exchanges over another group than its peers waits out the timeout, with nothing to say why."""
    if given is None or given is run_pg:
        return None
    import torch.distributed as dist
    theirs = dist.get_process_group_ranks(run_pg)
    ours = dist.get_process_group_ranks(given) if dist.get_rank(given) >= 0 else None
    if ours == theirs:
        return None
    told = ("a process_group this rank is not a member of" if ours is None else
            f"a process_group of {len(ours)}{' (other ranks)' if len(ours) == len(theirs) else ''}")
    return (f"rank {dist.get_rank()}: dcp runs over a group of {len(theirs)} ranks but shardcast's storage layer "
            f"was given {told}: pass it the process_group given to dcp.save/dcp.load, or none")


def run_group(given):
    """The group a storage layer given `given` (None: not told) runs over: `given` where told, else the
    process_group the calling dcp.load/dcp.save was given (None: the default group)."""
    if given is not None:
        return given
    run = dcp_run()
    return None if run is None else run[1]
