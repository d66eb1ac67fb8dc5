"""Warming the page cache while `from_pretrained` builds and shards the model.

Between knowing the checkpoint and the first byte the stream reads, `from_pretrained` spends seconds
importing the model's modeling module, building the meta model and running `fully_shard`, none of
which touches storage. On a cold page cache (a real 229B load is cold) those seconds can fetch the
files instead: each local rank asks the kernel (`posix_fadvise(POSIX_FADV_WILLNEED)`, no memory of the
process's own, nothing mapped; in steps of the device's read-ahead limit, since the kernel reads at
most that much per call) for its contiguous 1/L of the checkpoint's bytes, so the node reads the
files once, L requests at a time, while the CPU builds the model.

Bounds: one node only (several nodes each read only part of the files, which this cannot know before
the layout); at most half of MemAvailable in all, in file order (the stream reads in roughly that
order, and a checkpoint larger than memory must not evict what it will read first). It goes on during
the load, ahead of the stream's own bounded read-ahead, and stops when the load returns. On a warm page
cache each request is a walk over resident pages.

When: filling the page cache costs CPU (page allocation, the copy from the device), which overlaps the
build only where cores are spare. Measured on the 2-vCPU VM with 4 ranks (bench/RESULTS.md): a cold
6.4 GB from_pretrained took as long with it as without (the load phase 2 s shorter, the build 2 s
longer), so by default it runs only where the node has at least two CPUs a rank: the same node verdict
as the stream beside the build's, from from_pretrained's first exchange (_stream_rules.py: every rank's
hostname and affinity mask, so ranks bound to CPUs of their own by srun --cpu-bind count them once, and
the node's ranks and this rank's place among them need no launcher's variables).
"""
from __future__ import annotations

import glob
import os
import threading
from typing import List, Optional, Tuple


_STEP = 32 << 20  # bytes per request: the thread can stop between two


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def share(files: List[Tuple[str, int]], local_rank: int, local_world: int, budget: int) -> List[Tuple[str, int, int]]:
    """This rank's requests: (path, offset, length) covering its contiguous 1/local_world of the first
    `budget` bytes of the files taken in order."""
    total = min(budget, sum(size for _, size in files))
    begin, end = total * local_rank // local_world, total * (local_rank + 1) // local_world
    out, at = [], 0
    for path, size in files:
        lo, hi = max(begin, at), min(end, at + size)
        if lo < hi:
            out.append((path, lo - at, hi - lo))
        at += size
    return out


class Prefetch:
    """A daemon thread issuing this rank's read-ahead requests; `stop()` ends it (idempotent)."""

    def __init__(self, requests: List[Tuple[str, int, int]]):
        self.requested = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(requests,), name="shardcast-prefetch", daemon=True)
        self._thread.start()

    def _run(self, requests):
        from ._shardcast import prefetch_file_range
        for path, offset, length in requests:
            for at in range(offset, offset + length, _STEP):
                if self._stop.is_set():
                    return
                n = min(_STEP, offset + length - at)
                # Without the GIL. A file it cannot open is skipped: the load names it in its own error.
                if not prefetch_file_range(path, at, n):
                    break
                self.requested += n

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def wanted(prefetch: Optional[bool], verdict) -> bool:
    """Whether this rank reads ahead: never with prefetch=False, nor where the ranks are on several nodes
    (each node reads only part of the files, which this cannot know before the layout); with prefetch=True
    on one node; left to decide (None), where the node has two CPUs a rank (`verdict`: a
    _stream_rules.Verdict)."""
    if prefetch is False or verdict.nodes != 1:
        return False
    return bool(prefetch) or verdict.spare_cores


def start(checkpoint: str, local_rank: int, local_world: int) -> Optional[Prefetch]:
    """Starts this rank's share (the `local_rank`-th of `local_world`) of the read-ahead of `checkpoint`'s
    safetensors files; None where there is nothing to read."""
    files = []
    for path in sorted(glob.glob(os.path.join(checkpoint, "*.safetensors"))):
        try:
            files.append((path, os.path.getsize(path)))
        except OSError:
            continue
    requests = share(files, local_rank, local_world, _mem_available() // 2)
    return Prefetch(requests) if requests else None
