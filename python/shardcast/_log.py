"""The one-line INFO summary each load, save and from_pretrained leaves on `logging.getLogger("shardcast")`.

Rank 0 logs it, once per call; other ranks log nothing. The numbers are the report's: the bytes the
shards hold, the slowest rank's wall time, and their ratio in decimal GB/s (as `shardcast load` prints).

    shardcast: load of /ckpt: 16.2 GB in 9.81 s, 1.65 GB/s, source each-rank, 4 rank(s)
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping, Optional

logger = logging.getLogger("shardcast")


def logged(operation: str, where: str, rank: Optional[int], report: Any) -> Any:
    """Logs `report`'s summary when `rank` is 0 (None: this process's global rank) and returns `report`
    unchanged. `where`: the checkpoint read or the directory written."""
    if logger.isEnabledFor(logging.INFO) and (rank if rank is not None else _global_rank()) == 0:
        logger.info("%s", summary(operation, where, report))
    return report


def summary(operation: str, where: str, report: Any) -> str:
    r = _as_dict(report)
    ranks = r.get("ranks") or []
    seconds = max((float(x.get("seconds", 0.0)) for x in ranks), default=float(r.get("seconds", 0.0)))
    size = int(r.get("total_bytes", 0))
    rate = size / seconds / 1e9 if seconds > 0 else 0.0
    source = f"source {r['source']}" if "source" in r else f"mode {r.get('mode', '?')}"  # save's name for it
    line = (f"{operation} {'to' if operation == 'save' else 'of'} {where}: {_decimal(size)} in {seconds:.3f} s, "
            f"{rate:.2f} GB/s, {source}, {r.get('world_size', len(ranks) or 1)} rank(s)")
    if r.get("files"):
        line += f", {len(r['files'])} file(s)"
    return line


def _as_dict(report: Any) -> Mapping[str, Any]:
    if isinstance(report, Mapping):
        return report
    if hasattr(report, "to_dict"):
        return report.to_dict()
    return dataclasses.asdict(report)


def _decimal(size: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size} B"


def _global_rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
