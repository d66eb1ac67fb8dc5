"""from_pretrained's clock: each rank's wall time by phase, so the slowest part of a set-up is visible.

    import  transformers' and shardcast's modules, and the model's modeling module (its first import)
    config  the checkpoint resolved, its config read, the arguments checked (and where it streams beside
            the build: the header read, this rank's part planned, every rank's agreement to stream)
    build   the model on meta (a quantized layout, prepare's buffers)
    layout  the process group and mesh, fully_shard (or transformers' plans)
    stream  the load: handshake, allocation, the bytes landing in this rank's shards
    wait    this rank waiting for a stream that ran beside build and layout (0 when it ran after them)

Each phase is charged the time since the previous lap, so the phases of a sequential set-up add up to its
total. A stream beside build and layout is the exception: its own time overlaps theirs, and only what
the rank waited for it after layout (`wait`) is added.

Beside the wall time, the clock keeps the process's CPU time over the call (every thread's, user and
system): where the ranks of a node together use about all of its cores for the whole call, the set-up is
bound by CPU, and overlapping its phases cannot shorten it; where they use far fewer, it waits on
something else (the disk, a peer, the GIL).
"""
from __future__ import annotations

import time
from typing import Dict, List

PHASES = ("import", "config", "build", "layout", "stream", "wait")


class PhaseClock:
    """Seconds per phase on this rank. Not thread-safe: one thread laps it."""

    def __init__(self) -> None:
        self.start = self.last = time.monotonic()
        self.cpu_start = self.cpu_last = time.process_time()
        self.seconds: Dict[str, float] = dict.fromkeys(PHASES, 0.0)

    def lap(self, phase: str) -> None:
        """Charges the time since the previous lap (or the start) to `phase`."""
        now = time.monotonic()
        self.seconds[phase] += now - self.last
        self.last = now
        self.cpu_last = time.process_time()

    def charge(self, phase: str, seconds: float) -> None:
        """Adds `seconds` measured elsewhere (a stream on another thread) to `phase`, outside the laps."""
        self.seconds[phase] += seconds

    def total(self) -> float:
        return self.last - self.start

    def cpu(self) -> float:
        """CPU seconds this process used from the clock's start to its last lap (every thread: the stream's
        too), the span total() measures."""
        return self.cpu_last - self.cpu_start


def with_phases(report, every_rank: List[dict]):
    """`report` (a LoadReport) with each rank's row carrying its phases and from_pretrained's total
    (`every_rank`: [{"phases": {...}, "seconds": total, "cpu_seconds": its CPU time}] in rank order), as
    a new LoadReport."""
    from ._report import LoadReport
    raw = report.to_dict()
    for row in raw.get("ranks") or ():
        mine = every_rank[int(row.get("rank", 0))]
        row["phases"] = dict(mine["phases"])
        row["pretrained_seconds"] = float(mine["seconds"])
        row["pretrained_cpu_seconds"] = float(mine.get("cpu_seconds", 0.0))
    return LoadReport.from_dict(raw)
