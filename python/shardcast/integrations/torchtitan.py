"""shardcast as torchtitan's checkpoint storage: one config line.

    from shardcast.integrations.torchtitan import CheckpointManager
    config.checkpoint = CheckpointManager.Config(enable=True, folder="checkpoint", interval=500, ...)

`CheckpointManager` is torchtitan's own (`torchtitan.components.checkpointer.CheckpointManager`: its
config fields, its save interval, async modes, retention, resume and initial-load logic, unchanged), with
shardcast under its three storage steps:

    step              torchtitan's                                     this one's
    training state    dcp.save(checkpoint_id=...): torch's              shardcast.dcp.StorageWriter: safetensors +
      (interval)      FileSystemWriter, a pickled .metadata             .metadata.json, no pickle on disk
    resume            dcp.load(checkpoint_id=...): FileSystemReader     shardcast.dcp.StorageReader, at any world
                                                                        size and layout (torch's format still
                                                                        read, so older steps resume)
    initial HF load   the adapter's get_hf_storage_reader (torch's)     shardcast.dcp's reader of the same class,
                                                                        built from its arguments
    last HF save      torch's HF writer, per-rank files, then a         shardcast.dcp.HuggingFaceStorageWriter:
                      consolidation pass re-reading every byte          the finished checkpoint in one pass

The async modes call `dcp.async_save` as torchtitan does (over its Gloo group; "async_with_pinned_mem"
in a process of its own with its pinned stager), with shardcast's writer. A step folder counts as a
checkpoint when it holds `.metadata.json` (shardcast's), `.metadata` (torch's) or an HF index; one that
holds both metadata files (torch's manager saved over a shardcast step) is refused on resume, naming both,
rather than guessing which save is the newer. shardcast writes and reads local (or mounted) folders: a
remote `folder` or path ("gs://", "s3://", any "://" fsspec URL) is saved and loaded by torchtitan's own
steps (torch's format), with one warning saying so.

Tested with torchtitan 0.3.0's own Qwen3-MoE, OptimizersContainer, LRSchedulersContainer and
CheckpointManager at 4 ranks over Gloo (tests/python/test_dcp_torchtitan.py). It overrides
CheckpointManager's `dcp_save`, `dcp_load` and `_find_load_step`, which are torchtitan's internals:
another torchtitan version may need this module changed.
"""
from __future__ import annotations

import dataclasses
import os
import re
import time
import warnings
from typing import Any, Dict

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader as _TorchHFReader
from torch.distributed.checkpoint.quantized_hf_storage import (
    QuantizedHuggingFaceStorageReader as _TorchQuantizedReader)
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torchtitan.components.checkpointer.dcp import MODEL, AsyncMode
from torchtitan.components.checkpointer.dcp import CheckpointManager as _TitanManager
from torchtitan.tools import filesystem
from torchtitan.tools.utils import GarbageCollection

from .. import dcp as _sdcp
from .._shardcast import CheckpointError
from ..dcp._state_codec import METADATA_NAME

_TORCH_METADATA = ".metadata"  # torch's FileSystemWriter's

__all__ = ["CheckpointManager", "shardcast_reader"]


def shardcast_reader(reader):
    """shardcast.dcp's reader for a reader a torchtitan adapter made: torch's HuggingFaceStorageReader or
    QuantizedHuggingFaceStorageReader become shardcast's of the same class and arguments (path,
    thread_count; target_dtype and block_size); any other reader (shardcast's already, or one of the
    user's own) is returned as it is."""
    if type(reader) is _TorchQuantizedReader:
        # 128 is torch's default, which its adapters pass whatever the checkpoint says: the checkpoint's
        # config then decides here (another block, given, is asked for and checked against it)
        block = None if reader.block_size == 128 else reader.block_size
        return _sdcp.QuantizedHuggingFaceStorageReader(reader.path, thread_count=reader.thread_count,
                                                       target_dtype=reader.target_dtype, block_size=block)
    if type(reader) is _TorchHFReader:
        return _sdcp.HuggingFaceStorageReader(reader.path, thread_count=reader.thread_count)
    return reader


class CheckpointManager(_TitanManager):
    """torchtitan's CheckpointManager, storing through shardcast.dcp (module docstring). Built as torchtitan
    builds its own: `CheckpointManager.Config(...)` in the trainer's config (`config.checkpoint`)."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(_TitanManager.Config):
        """torchtitan's checkpoint config, field for field, and shardcast's own below."""

        allow_pickle: bool = False
        """Values in the training state that are not plain data (an Enum, a set, a class of the user's in a
        state_dict()) kept as torch.save bytes (shardcast.dcp.StorageWriter/StorageReader's allow_pickle),
        where by default such a value fails the save on every rank, naming its key. torchtitan's own states
        (model, optimizers, LR schedulers, dataloader, train_state) are plain data."""

    def __init__(self, config: Config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        self.allow_pickle = getattr(config, "allow_pickle", False)

    def _remote(self, checkpoint_id: str) -> bool:
        """Whether `checkpoint_id` is a remote URL, which torchtitan's own steps store (warned once)."""
        if not filesystem.is_remote(checkpoint_id):
            return False
        if not getattr(self, "_warned_remote", False):
            self._warned_remote = True
            warnings.warn(f"shardcast: {checkpoint_id} is a remote URL; shardcast writes and reads local or "
                          "mounted folders, so torchtitan's own storage (torch's format) saves and loads it",
                          stacklevel=3)
        return True

    @torch.no_grad()
    def dcp_save(self, state_dict: Dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False, to_hf: bool = False):
        if self._remote(checkpoint_id):
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        if to_hf:
            assert self.sd_adapter is not None, "sd_adapter is required for to_hf=True"
            state_dict = self.sd_adapter.to_hf(state_dict)
            writer = _sdcp.HuggingFaceStorageWriter(checkpoint_id,
                                                    fqn_to_index_mapping=self.sd_adapter.fqn_to_index_mapping)
        else:
            writer = _sdcp.StorageWriter(checkpoint_id, allow_pickle=self.allow_pickle)
        if async_mode == AsyncMode.ASYNC:
            ret = dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg)
        elif async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            ret = dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg,
                                 async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=self.stager)
        else:
            ret = dcp.save(state_dict, storage_writer=writer)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    def dcp_load(self, state_dict: Dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        if self._remote(checkpoint_id):
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        kind = "hf" if from_hf else self._folder_kind(checkpoint_id)
        if kind.startswith("mixed"):
            raise CheckpointError(kind[len("mixed "):])
        if from_hf:
            assert self.sd_adapter is not None, ("trying to load checkpoint in HF safetensors format, but sd_adapter "
                                                 "is not provided.")
            hf_state_dict = self.sd_adapter.to_hf(state_dict)
            reader = shardcast_reader(self.sd_adapter.get_hf_storage_reader(checkpoint_id, from_quantized))
            dcp.load(hf_state_dict, storage_reader=reader)
            self.states[MODEL].load_state_dict(self.sd_adapter.from_hf(hf_state_dict))
        elif kind == "torch":  # torch's own format: a step saved before shardcast was the storage
            super().dcp_load(state_dict, checkpoint_id, from_hf=False, from_quantized=False)
        else:  # shardcast's, or neither metadata (an unfinished save, load(step=N) naming it): its reader says so
            dcp.load(state_dict, storage_reader=_sdcp.StorageReader(checkpoint_id, allow_pickle=self.allow_pickle))
            if MODEL in self.states:  # as torchtitan's: the model's states are flattened into state_dict
                self.states[MODEL].load_state_dict(state_dict)

    def _folder_kind(self, checkpoint_id: str) -> str:
        """Which save a step folder holds, as rank 0 sees it (one answer for every rank, so no rank takes
        another reader, or raises alone, on a shared file system whose ranks see it late): "ours", "torch",
        "none" (neither metadata), or "mixed <the error's words>"."""
        kind = [None]
        if not dist.is_initialized() or dist.get_rank(self.pg) == 0:
            kind[0] = _folder_kind(checkpoint_id)
        if dist.is_initialized():
            dist.broadcast_object_list(kind, group=self.pg, group_src=0)
        return kind[0]

    def _find_load_step(self, folder: str = "") -> int:
        step = super()._find_load_step(folder)
        folder = folder or self.folder
        if filesystem.is_remote(folder) or not filesystem.isdir(folder):  # remote: torchtitan's own steps
            return step
        ours = [int(m.group(1)) for name in filesystem.listdir(folder) if (m := re.search(r"step-(\d+)", name))
                and filesystem.isfile(filesystem.join(filesystem.join(folder, name), METADATA_NAME))]
        return max([step, *ours])


def _folder_kind(checkpoint_id: str) -> str:
    """What _folder_kind (the method) answers, read here."""
    ours = os.path.join(checkpoint_id, METADATA_NAME)
    torchs = os.path.join(checkpoint_id, _TORCH_METADATA)
    if os.path.isfile(ours) and os.path.isfile(torchs):
        return (f"mixed {checkpoint_id} holds two saves: shardcast's {METADATA_NAME} (written {_mtime(ours)}) "
                f"and torch's {_TORCH_METADATA} (written {_mtime(torchs)}), each with its own files; remove the "
                "stale one's metadata (or the folder) and resume again")
    if os.path.isfile(ours):
        return "ours"
    return "torch" if os.path.isfile(torchs) else "none"


def _mtime(path: str) -> str:
    """When `path` was last written, as local time to the second ("?" where it is gone)."""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(os.path.getmtime(path)))
    except OSError:
        return "?"
