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

import importlib
import importlib.util
from typing import TYPE_CHECKING

from ._version import __version__  # noqa: F401  (written once, in _version.py)

# Where each public name lives. Importing shardcast imports none of them: torch (2-3 s of start-up on a
# small machine) loads on the first use of a name, so `python -m shardcast --version` and the console
# script start without it (PEP 562). `shardcast.X`, `from shardcast import X` and `import *` all resolve
# through __getattr__; a submodule (`shardcast._load`, `shardcast.dcp`) is imported on first access.
_PUBLIC = {
    "CheckpointError": "_shardcast", "CommError": "_shardcast", "CommTimeout": "_shardcast",
    "ConfigError": "_shardcast", "InternalError": "_shardcast", "InvalidArgument": "_shardcast",
    "IoError": "_shardcast", "ManifestMismatch": "_shardcast", "ShardcastError": "_shardcast",
    "Unsupported": "_shardcast",
    "load": "_load",
    "BufferInit": "_prepare", "prepare": "_prepare",  # BufferInit: the buffer_init callable's type
    "from_pretrained": "_pretrained",
    "LoadRank": "_report", "LoadReport": "_report", "SaveRank": "_report", "SaveReport": "_report",
    "save": "_save",
}

__all__ = [
    "prepare", "load", "save", "ShardcastError", "ManifestMismatch", "CheckpointError", "CommTimeout", "CommError",
    "ConfigError", "InvalidArgument", "IoError", "Unsupported", "InternalError",
    "from_pretrained", "LoadReport", "LoadRank", "SaveReport", "SaveRank",
]

if TYPE_CHECKING:  # what type checkers and IDEs see: the names, eagerly
    from ._load import load
    from ._prepare import BufferInit, prepare
    from ._pretrained import from_pretrained
    from ._report import LoadRank, LoadReport, SaveRank, SaveReport
    from ._save import save
    from ._shardcast import (CheckpointError, CommError, CommTimeout, ConfigError, InternalError, InvalidArgument,
                             IoError, ManifestMismatch, ShardcastError, Unsupported)


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
        globals()[name] = value  # resolved once; later accesses are plain attribute reads
        return value
    if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f".{name}", __name__)  # binds itself as an attribute of the package
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():  # the package's names, not the tools of this file (annotations, importlib, TYPE_CHECKING)
    return sorted((set(globals()) - {"annotations", "importlib", "TYPE_CHECKING"}) | set(_PUBLIC))
