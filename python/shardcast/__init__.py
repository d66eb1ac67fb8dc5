"""shardcast for FSDP2 training scripts.

    with torch.device("meta"):
        model = build_model(config)
    shardcast.prepare(model, config=config)        # params stay meta; non-persistent buffers computed
    for block in model.model.layers:
        fully_shard(block)
    fully_shard(model)
    report = shardcast.load(model, checkpoint_dir)  # each rank receives only its own rows

Every rank calls `load` together. Errors are one exception class per kind of failure, all subclasses
of `ShardcastError`, with the same message on every rank.
"""
from __future__ import annotations

from ._shardcast import (  # noqa: F401  (re-exported)
    CheckpointError,
    CommError,
    CommTimeout,
    ConfigError,
    InternalError,
    InvalidArgument,
    IoError,
    ManifestMismatch,
    ShardcastError,
    Unsupported,
)
from ._load import load
from ._prepare import BufferInit, prepare  # noqa: F401  (BufferInit: the buffer_init callable's type)
from ._pretrained import from_pretrained
from ._report import LoadRank, LoadReport, SaveRank, SaveReport
from ._save import save
from ._version import __version__  # noqa: F401  (written once, in _version.py)

__all__ = [
    "prepare", "load", "save", "ShardcastError", "ManifestMismatch", "CheckpointError", "CommTimeout", "CommError",
    "ConfigError", "InvalidArgument", "IoError", "Unsupported", "InternalError",
    "from_pretrained", "LoadReport", "LoadRank", "SaveReport", "SaveRank",
]
