"""shardcast behind torch.distributed.checkpoint: storage readers and writers under torch's own class names.

    import torch.distributed.checkpoint as dcp
    from shardcast.dcp import HuggingFaceStorageReader

    dcp.load(hf_state_dict, storage_reader=HuggingFaceStorageReader(path))

Each class can be used wherever torch's class of the same name is used (the same positional constructor
surface; shardcast's own options are keyword-only). DCP's planner still maps names and reshards; shardcast
moves the bytes: the checkpoint is opened once and agreed on by every rank, and every read lands in the
planner's destination tensors through shardcast's bounded staging, with one agreed error on every rank
when anything is wrong.
"""
from __future__ import annotations

from ._hf_reader import HuggingFaceStorageReader, QuantizedHuggingFaceStorageReader

__all__ = ["HuggingFaceStorageReader", "QuantizedHuggingFaceStorageReader"]
