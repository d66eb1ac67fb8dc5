"""shardcast behind torch.distributed.checkpoint: storage readers and writers under torch's own class names.

    import torch.distributed.checkpoint as dcp
    from shardcast.dcp import HuggingFaceStorageReader, HuggingFaceStorageWriter, StorageReader, StorageWriter

    dcp.load(hf_state_dict, storage_reader=HuggingFaceStorageReader(path))       # a Hugging Face checkpoint
    dcp.save(hf_state_dict, storage_writer=HuggingFaceStorageWriter(path))       # one pass, no consolidation
    dcp.save(train_state, storage_writer=StorageWriter(path))                    # model + optimizer, no pickle
    dcp.load(train_state, storage_reader=StorageReader(path))                    # at any world size and layout

Each class can be used wherever torch's class of the same name is used (the same positional constructor
surface; shardcast's own options are keyword-only). DCP's planner still maps names and reshards; shardcast
moves the bytes: the checkpoint is opened once and agreed on by every rank, and every read lands in the
planner's destination tensors through shardcast's bounded staging, with one agreed error on every rank
when anything is wrong.
"""
from __future__ import annotations

from ._hf_quantized import QuantizedHuggingFaceStorageReader
from ._hf_reader import HuggingFaceStorageReader
from ._hf_writer import HuggingFaceStorageWriter
from ._state import StorageReader, StorageWriter

__all__ = ["HuggingFaceStorageReader", "QuantizedHuggingFaceStorageReader", "HuggingFaceStorageWriter",
           "StorageReader", "StorageWriter"]
