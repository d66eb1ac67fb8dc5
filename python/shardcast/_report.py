"""What `load` and `save` return: typed reports built from the C++ core's JSON report.

    report = shardcast.load(model, path)
    report.seconds, report.gbps, report.source, report.ranks[0].peak_rss_anon_above_baseline
    report.to_dict()          # exactly the dict of earlier releases (and of `shardcast load --json`)
    report["source"]          # and the report still is that dict: report["ranks"], json.dumps(report)

The dict stays the one source: every field is read from it, and keys only some loads carry (a
verify's detail, a quantized load's counts) are there through `report[...]` and `to_dict()`. A report
is a dict subclass so that every caller of earlier releases (`report["..."]`, `.get`, `in`,
`json.dumps(report)`, `report == {...}`) keeps working; the fields are read-only.
Times are seconds, sizes bytes, throughput decimal GB/s (the bytes the shards hold over the slowest
rank's wall time, as the INFO line and `shardcast load` print it).
"""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any, Dict, Tuple

__all__ = ["LoadReport", "LoadRank", "SaveReport", "SaveRank"]


def _fields(cls, raw: Mapping) -> Dict[str, Any]:
    """The dataclass fields of `cls` that `raw` carries (a missing key keeps the field's default)."""
    return {f.name: raw[f.name] for f in dataclasses.fields(cls) if f.init and f.name in raw}


class _DictView(dict):
    """The report's dict itself (its items are the C++ core's JSON report), with typed fields beside it."""

    @classmethod
    def from_dict(cls, raw: Mapping):
        report = cls(**cls._typed(raw))
        dict.update(report, raw)
        return report

    @classmethod
    def _typed(cls, raw: Mapping) -> Dict[str, Any]:
        return _fields(cls, raw)

    def to_dict(self) -> Dict[str, Any]:
        """The report as the dict of earlier releases (a copy: changing it changes nothing here)."""
        return copy.deepcopy(dict(self))


@dataclasses.dataclass(frozen=True, eq=False)
class LoadRank(_DictView):
    """One rank's share of a load: its wall time by phase (seconds), its traffic (bytes), and its resident
    memory above what it held before the load (bytes; peaks over the load). From `from_pretrained`, also
    its whole set-up: `phases` {import, config, build, layout, stream, wait: seconds} (see _phases.py),
    their total `pretrained_seconds` and the CPU time of the rank's process over it (every thread,
    `pretrained_cpu_seconds`); a plain load leaves them empty and 0."""
    rank: int = 0
    seconds: float = 0.0
    handshake_seconds: float = 0.0
    allocate_seconds: float = 0.0
    stream_seconds: float = 0.0
    verify_seconds: float = 0.0
    cpu_seconds: float = 0.0
    bytes_read: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_stored: int = 0
    read_threads: int = 0          # threads that read this rank's bytes (0: it read none)
    commit_threads: int = 0        # threads that committed its host shards beside the stream (0: none, as
                                   # for the caller's own tensors where the process may not lift their idle
                                   # priority: README, `load`)
    commit_threads_let_go: int = 0  # of those, let go at the stream's end (their priority could not be
                                    # lifted: no CAP_SYS_NICE, RLIMIT_NICE under 20); they end on their own
    pinned_staging_bytes: int = 0  # page-locked staging (a CUDA target); 0: pageable
    pin_seconds: float = 0.0       # the part of stream_seconds spent page-locking it
    peak_rss_anon_above_baseline: int = 0
    peak_rss_file_above_baseline: int = 0
    verify: str = "off"
    phases: Mapping[str, float] = dataclasses.field(default_factory=dict)
    pretrained_seconds: float = 0.0
    pretrained_cpu_seconds: float = 0.0


@dataclasses.dataclass(frozen=True, eq=False)
class SaveRank(_DictView):
    """One rank's share of a save: its wall time by phase (seconds), what it wrote and sent (bytes), and its
    resident memory above what it held before the save (bytes)."""
    rank: int = 0
    seconds: float = 0.0
    layout_seconds: float = 0.0
    create_seconds: float = 0.0
    stream_seconds: float = 0.0
    sync_seconds: float = 0.0
    commit_seconds: float = 0.0
    bytes_read: int = 0
    bytes_written: int = 0
    files_written: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    peak_rss_anon_above_baseline: int = 0
    peak_rss_file_above_baseline: int = 0


class _Totals:
    """What every report derives from its rows: the slowest rank's time, GB/s and the peaks."""
    ranks: Tuple[Any, ...]
    total_bytes: int

    @property
    def seconds(self) -> float:
        """The slowest rank's wall time: the operation's duration."""
        return max((r.seconds for r in self.ranks), default=0.0)

    @property
    def gbps(self) -> float:
        """total_bytes over `seconds`, in decimal GB/s (0.0 for an instant operation)."""
        return self.total_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def peak_rss_anon_bytes(self) -> int:
        """The largest anonymous resident memory any rank added during the operation."""
        return max((r.peak_rss_anon_above_baseline for r in self.ranks), default=0)


@dataclasses.dataclass(frozen=True, eq=False)
class LoadReport(_Totals, _DictView):
    """What `shardcast.load` returns, the same on every rank: who read (source, and why), where the shards
    went (target), the sizes, and one LoadRank per rank in `ranks`. stream_beside_build: from_pretrained
    streamed the parameters while it built the model (its ranks' `stream` phase overlaps build and layout);
    the report is then that stream's, its parameters' bytes."""
    source: str = ""
    source_reason: str = ""
    target: str = "cpu"
    backend: str = ""
    world_size: int = 1
    nodes: int = 1
    mesh: str = ""
    entries: int = 0
    total_bytes: int = 0
    checkpoint_bytes: int = 0
    skipped_keys: int = 0
    dequantized: int = 0
    chunk_bytes: int = 0
    staging_slots: int = 0
    setup_only: bool = False
    stream_beside_build: bool = False
    ranks: Tuple[LoadRank, ...] = ()

    @classmethod
    def _typed(cls, raw: Mapping) -> Dict[str, Any]:
        fields = _fields(cls, raw)
        fields["ranks"] = tuple(LoadRank.from_dict(r) for r in raw.get("ranks") or ())
        return fields


@dataclasses.dataclass(frozen=True, eq=False)
class SaveReport(_Totals, _DictView):
    """What `shardcast.save` returns, the same on every rank: who wrote (source; the dict's "mode"), the
    files written into out_dir, the sizes, and one SaveRank per rank in `ranks`."""
    out_dir: str = ""
    source: str = ""
    backend: str = ""
    world_size: int = 1
    entries: int = 0
    tensors: int = 0
    total_bytes: int = 0
    files: Tuple[str, ...] = ()
    chunk_bytes: int = 0
    staging_slots: int = 0
    ranks: Tuple[SaveRank, ...] = ()

    @classmethod
    def _typed(cls, raw: Mapping) -> Dict[str, Any]:
        fields = _fields(cls, raw)
        fields["source"] = raw.get("mode", "")
        fields["files"] = tuple(raw.get("files") or ())
        fields["ranks"] = tuple(SaveRank.from_dict(r) for r in raw.get("ranks") or ())
        return fields
