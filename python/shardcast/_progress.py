"""progress=: what load and save take for it, and rank 0's progress line (a tqdm bar where tqdm is installed)."""
from __future__ import annotations

from ._shardcast import InvalidArgument


def _progress(progress, rank: int, operation: str = "load"):
    """progress= as the binding takes it: None, or a callable(done_bytes, total_bytes) on this rank.
    None (not given): a progress line on rank 0 when its stderr is a terminal, else none."""
    if progress is None:
        progress = _stderr_is_a_terminal()
    if progress is True:
        return _progress_printer(operation) if rank == 0 else None
    if progress is False:
        return None
    if not callable(progress):
        raise InvalidArgument(f"progress={progress!r}: expected True, False, None or a callable(done_bytes, "
                              f"total_bytes), got {type(progress).__name__}")
    return progress


def _stderr_is_a_terminal() -> bool:
    import sys
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stderr
        return False


def _progress_printer(operation: str = "load"):
    """The CLI's progress line on stderr (or a tqdm bar where tqdm is installed), for rank 0."""
    import sys
    import time
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    state = {"bar": None, "t0": None}

    def show(done: int, total: int):
        if tqdm is not None:
            if state["bar"] is None:
                state["bar"] = tqdm(total=total, unit="B", unit_scale=True, desc=f"shardcast {operation}")
            state["bar"].update(done - state["bar"].n)
            if done >= total:
                state["bar"].close()
            return
        now = time.monotonic()
        state["t0"] = state["t0"] or now
        secs = max(now - state["t0"], 1e-9)
        gbs = done / secs / 1e9
        eta = (total - done) / 1e9 / gbs if gbs > 0 else 0.0
        sys.stderr.write(f"\rshardcast {operation}: {done / 2**30:.2f} / {total / 2**30:.2f} GiB ({100 * done / max(total, 1):.0f}%) "
                         f"{gbs:.2f} GB/s ETA {eta:.1f} s" + ("\n" if done >= total else ""))
        sys.stderr.flush()
    return show
