"""A failure on one rank carried into the operation's agreement, whose verdict raises it on every rank:
the problem as the binding takes it (kind, message[, ranks]), and the call that chains this rank's own
exception to that verdict."""
from __future__ import annotations

from typing import Optional

from ._shardcast import ShardcastError


class _Problem(tuple):
    """(kind, message) of a failure on this rank, as the binding takes it, with the exception itself as
    `cause`: the verdict raised on this rank chains it (`raise verdict from cause`). A CommTimeout of an
    exchange that named the ranks which never came adds them: (kind, message, [ranks])."""
    cause: Optional[BaseException] = None


def _problem(e: BaseException) -> tuple:
    """(kind, message) of a failure on this rank, carried into the agreement, whose verdict raises it on
    every rank, naming this rank: a ShardcastError keeps its class; a timeout (TimeoutError, or a c10d
    store's DistStoreError) is a CommTimeout and a lost store (DistNetworkError) a CommError; anything
    else is an InternalError naming its own type."""
    if isinstance(e, ShardcastError):
        kind, message = type(e).__name__, str(e)
    else:
        kind, message = _comm_kind(e) or "InternalError", f"{type(e).__name__}: {e}"
    absent = getattr(e, "absent_ranks", None)
    problem = _Problem((kind, message, list(absent)) if absent else (kind, message))
    problem.cause = e
    return problem


def _comm_kind(e: BaseException) -> Optional[str]:
    if isinstance(e, TimeoutError):
        return "CommTimeout"
    import torch.distributed as dist
    if isinstance(e, getattr(dist, "DistStoreError", ())):
        return "CommTimeout"
    if isinstance(e, getattr(dist, "DistNetworkError", ())):
        return "CommError"
    return None


def _agreed(problem, call):
    """call() (the agreement and what follows), whose verdict on this rank chains this rank's own exception
    where it had one, so its traceback is not lost at the binding. Where this rank's problem is a store that
    stopped answering or is lost (`store_stalled`), there is nothing to agree through: it is raised at once, as
    every rank on that store raises it (the agreement would only wait out the rendezvous deadline, 1.25 x the timeout, first).
    REQUIRES: the operation's store (operation_store) taken before, so that every rank numbers this
    operation alike whichever way it ends."""
    cause = getattr(problem, "cause", None)
    if cause is not None and getattr(cause, "store_stalled", False):
        raise cause
    try:
        return call()
    except ShardcastError as verdict:
        cause = getattr(problem, "cause", None)
        if cause is not None and verdict.__cause__ is None and verdict is not cause:
            raise verdict from cause
        raise
