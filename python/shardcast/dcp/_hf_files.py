"""The pieces of a directory of safetensors files read file by file, as torch's HF reader reads a directory
without an index: torch's per-rank files (`HuggingFaceStorageWriter(save_distributed=True)` without its
consolidation: "shard-0000r-model-0000k-of-0000n.safetensors", each tensor's piece placed by the file's
DCP_SHARDING_INFO), or whole tensors, one file each. Validated as hostile input: every header by the loader's
reader, the placement of every piece, and the pieces of each key filling its shape exactly once."""
from __future__ import annotations

import json
import os
from typing import Dict, List

from .. import _shardcast
from ._cover import cover_problem

SHARDING_INFO = "DCP_SHARDING_INFO"  # torch's per-rank files: {fqn: {"saved_offsets": [...]}} in __metadata__


def pieces_by_file(path: str) -> List[list]:
    """[[key, dtype name, piece shape, file, offsets]] of every piece in the safetensors files of `path`:
    placed by each file's DCP_SHARDING_INFO (torch's per-rank files), or, where no file has it, each tensor
    whole in its file. Every file is validated by the loader's reader; the pieces of a key must share its
    dtype and fill its shape exactly once, else a CheckpointError naming the key and its files (a key in
    two files without DCP_SHARDING_INFO is two pieces that overlap)."""
    names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    headers = [(n, *_shardcast.safetensors_header(path, n)) for n in names]
    placed = any(SHARDING_INFO in meta for _, meta, _ in headers)
    pieces: List[list] = []
    for name, meta, tensors in headers:
        file = os.path.join(path, name)
        if not placed:
            pieces += [[key, dtype, list(shape), file, [0] * len(shape)] for key, dtype, shape, _, _ in tensors]
            continue
        if SHARDING_INFO not in meta:
            raise _shardcast.CheckpointError(f"{file}: has no {SHARDING_INFO} where the other files of {path} "
                                             "have it (files of two checkpoints in one directory?)")
        try:
            info = json.loads(meta[SHARDING_INFO])
        except ValueError as e:
            raise _shardcast.CheckpointError(f"{file}: {SHARDING_INFO} is not JSON ({e})") from None
        for key, dtype, shape, _, _ in tensors:
            offsets = info.get(key, {}).get("saved_offsets") if isinstance(info, dict) and isinstance(
                info.get(key), dict) else None
            if (not isinstance(offsets, list) or len(offsets) != len(shape)
                    or not all(isinstance(o, int) and not isinstance(o, bool) and 0 <= o < 1 << 62 for o in offsets)):
                raise _shardcast.CheckpointError(f"{file}: key '{key}': {SHARDING_INFO} gives no offsets of "
                                                 f"{len(shape)} non-negative integers for it ({offsets!r})")
            pieces.append([key, dtype, list(shape), file, offsets])
    by_key: Dict[str, list] = {}
    for piece in pieces:
        by_key.setdefault(piece[0], []).append(piece)
    for key, group in by_key.items():
        ndim = {len(p[2]) for p in group}
        extent = [max(p[4][d] + p[2][d] for p in group) for d in range(min(ndim))]
        dtypes = {p[1] for p in group}
        why = (f"dtypes {sorted(dtypes)}" if len(dtypes) > 1 else f"{sorted(ndim)} dims" if len(ndim) > 1
               else cover_problem(extent, [(p[4], p[2]) for p in group]))
        if why is not None:
            files = ", ".join(f"{os.path.basename(p[3])} {p[2]} at {p[4]}" for p in group[:8])
            raise _shardcast.CheckpointError(
                f"{path}: key '{key}': its pieces ({files}{', ...' if len(group) > 8 else ''}) do not fill its "
                f"shape {extent} exactly once: {why}")
    return pieces
