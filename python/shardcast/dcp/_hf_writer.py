"""HuggingFaceStorageWriter: torch's HF writer's surface, shardcast's save engine underneath.

    import torch.distributed.checkpoint as dcp
    from shardcast.dcp import HuggingFaceStorageWriter

    dcp.save(hf_state_dict, storage_writer=HuggingFaceStorageWriter(path))

writes a finished Hugging Face checkpoint (model-0000k-of-0000n.safetensors + model.safetensors.index.json)
in one pass: no gather, no per-rank files, no consolidation afterwards. torch's writer with
save_distributed=True, enable_consolidation=True writes every rank's pieces into files of its own under
path/sharded, then rank 0 reads them all back and writes the whole tensors; here each rank writes its
pieces once, at their final offsets.

How DCP's steps map onto shardcast's save (runtime/save.h):

    prepare_global_plan   the coordinator sees every rank's WriteItems after DCP's planner kept each
    (coordinator)         replicated item on one rank. Each key becomes an explicit-box layout: the
                          chunk (offsets, sizes) of every rank that writes a non-empty piece of it.
                          The key order, global shapes, dtypes and that layout table go into every
                          rank's plan (storage_data). A non-tensor item is an InvalidArgument here.
    write_data            every rank: its own chunks (planner.resolve_data) as the local tensors of
    (every rank)          those layouts, an empty one where it writes nothing, into save_entries: rank 0
                          lays the files out (by fqn_to_index_mapping, else by max_shard_size), every
                          rank pwrites its boxes at their offsets, rank 0 commits the directory
                          atomically. One agreed error on every rank, never a hang.
    finish                nothing: the index was written with the files.

`path` may already hold a checkpoint and other files (config.json, a tokenizer): the new checkpoint is
built in path.tmp-<id> and swapped in atomically; what the old directory holds besides its safetensors
files and index is carried over (hard links). A save killed midway leaves the previous `path` as it was;
its leftover tmp directory is removed by the next save.
"""
from __future__ import annotations

import dataclasses
import os
import uuid
from typing import Dict, List, Optional, Tuple, Union

import torch
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from .. import _shardcast
from .._group import _group
from .._shardcast import InvalidArgument, ShardcastError, Unsupported
from ._agree import alone as _alone, dcp_run, group_problem, logged, run_group
from ._cover import cover_problem

__all__ = ["HuggingFaceStorageWriter"]


@dataclasses.dataclass(frozen=True)
class _SaveLayout:
    """What the coordinator put in every rank's plan: the save's entries in one order, and their layouts.

    keys: (key, global shape, dtype, layout index), in the state dict's order; layout index -1 (a tensor
    of no elements) is replicated. layouts: the table save_entries takes, explicit boxes only."""
    keys: Tuple[Tuple[str, Tuple[int, ...], torch.dtype, int], ...]
    layouts: list
    local: bool = False  # one rank saves alone (dcp.save(no_dist=True) while the group runs): a world of one


class HuggingFaceStorageWriter(StorageWriter):
    """torch.distributed.checkpoint.hf_storage.HuggingFaceStorageWriter, written by shardcast's save engine.

    Positional arguments as torch's: path; fqn_to_index_mapping ({key: file number from 1}: torchtitan
    passes the original checkpoint's index so that files keep their layout; None splits by max_shard_size);
    thread_count, save_distributed=True with enable_consolidation=True, and thread_count_consolidation are
    accepted and change nothing: every rank always writes its own pieces into the finished files.
    save_distributed=True with enable_consolidation=False asks for torch's per-rank files instead
    ("shard-0000r-model-...safetensors" with DCP_SHARDING_INFO, which torchtitan's and transformers'
    sharded saves consolidate afterwards): those are written by torch's own writer, unchanged, and read
    back by shardcast's HuggingFaceStorageReader as they are.

    Keyword-only (shardcast's): max_shard_size ("5GB", decimal as transformers', or bytes; without a
    mapping), source ("each-rank": every rank writes, one filesystem every rank sees at the same path;
    "rank0": rank 0 writes what the others stream to it, for node-local disks), timeout (seconds per
    collective), process_group (the group dcp.save runs over; default: the process_group dcp.save was
    given, else the default group), chunk_bytes,
    staging_slots, progress (True, or a callable(done_bytes, total_bytes)).

    Every failure is a shardcast error (InvalidArgument, CommError, IoError, ...) on every rank, which DCP
    wraps in its CheckpointException.
    """

    def __init__(self, path: Union[str, os.PathLike], fqn_to_index_mapping: Optional[Dict[str, int]] = None,
                 thread_count: int = 1, save_distributed: bool = False, enable_consolidation: bool = False,
                 thread_count_consolidation: int = 1, *, max_shard_size: Union[int, str] = "5GB",
                 source: str = "each-rank", timeout: Optional[float] = None, process_group=None,
                 chunk_bytes: Optional[Union[int, str]] = None, staging_slots: Optional[int] = None,
                 progress=None) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.fqn_to_index_mapping = fqn_to_index_mapping
        self.thread_count = thread_count
        self.save_distributed = save_distributed
        self.enable_consolidation = enable_consolidation
        self.thread_count_consolidation = thread_count_consolidation
        self.max_shard_size = max_shard_size
        self.source = source
        self.timeout = timeout
        self.process_group = process_group
        self.chunk_bytes = chunk_bytes
        self.staging_slots = staging_slots
        self.progress = progress
        self.is_coordinator = False
        self._use_collectives = True  # dcp.save(use_collectives=False): every rank plans and writes alone
        self.report: Optional[dict] = None  # this rank's save report (runtime/save.h), after write_data
        self.save_id = uuid.uuid4().hex  # each save's own, as torch's writers: in storage_meta
        self._per_rank_files = None  # torch's writer, where per-rank files are asked for
        if save_distributed and not enable_consolidation:
            from torch.distributed.checkpoint import HuggingFaceStorageWriter as _TorchWriter
            self._per_rank_files = _TorchWriter(self.path, fqn_to_index_mapping=fqn_to_index_mapping,
                                                thread_count=thread_count, save_distributed=True,
                                                enable_consolidation=False)

    # -- StorageWriter ------------------------------------------------------------------------------------
    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        if self._per_rank_files is not None:
            self._per_rank_files.reset(checkpoint_id)
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        return FileSystem.validate_checkpoint_id(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self.is_coordinator = is_coordinator
        self._use_collectives = kwargs.get("use_collectives", True)
        run = dcp_run()
        if run is not None and run[0]:  # on this rank, before DCP's gather: every rank hears of it there
            problem = group_problem(self.process_group, run[1])
            if problem is not None:
                raise InvalidArgument(f"{self.path}: {problem}")
        if self._per_rank_files is not None:
            self._per_rank_files.set_up_storage_writer(is_coordinator, *args, **kwargs)

    def storage_meta(self) -> Optional[StorageMeta]:
        if self._per_rank_files is not None:
            return self._per_rank_files.storage_meta()
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if self._per_rank_files is not None:
            return self._per_rank_files.prepare_local_plan(plan)
        # this rank's mapping, for the coordinator to match (rank 0's would govern the files unseen)
        return dataclasses.replace(plan, storage_data=("mapping", _mapping_digest(self.fqn_to_index_mapping)))

    def prepare_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
        if self._per_rank_files is not None:
            return self._per_rank_files.prepare_global_plan(plans)
        if not any(p.usable for p in plans):  # DCP's plan cache: every rank keeps its cached final plan
            return plans
        if not all(p.usable for p in plans):
            raise Unsupported("a save plan cached on some ranks only (DefaultSavePlanner(enable_plan_caching=True) "
                              "after the state dict changed): save without plan caching")
        mine = _mapping_digest(self.fqn_to_index_mapping)
        for r, p in enumerate(plans):
            theirs = p.storage_data[1] if isinstance(p.storage_data, tuple) and p.storage_data[:1] == ("mapping",) \
                else None
            if theirs is not None and theirs != mine:
                raise InvalidArgument(f"{self.path}: rank {r}'s fqn_to_index_mapping ({theirs[0]} keys, digest "
                                      f"{theirs[1]}) differs from the coordinator's ({mine[0]} keys, digest {mine[1]}): "
                                      "every rank must pass the same one")
        group = run_group(self.process_group)
        world = _group(group)[2]
        if not self._use_collectives and world > 1:
            # Each rank would build and swap in the same directory on its own: the saves race (one removes
            # another's unfinished build), and the last one in holds only its own rank's tensors.
            raise InvalidArgument(f"{self.path}: dcp.save(use_collectives=False) has each of the group's {world} "
                                  "ranks write this one Hugging Face checkpoint alone; save with collectives, or "
                                  "on one rank with no_dist=True")
        local = _alone(plans, group)
        try:
            layout = _global_layout(plans)
        except InvalidArgument as e:
            if not local:
                raise
            raise InvalidArgument(f"{e}. This rank saves alone (dcp.save with no_dist=True, or "
                                  "use_collectives=False) but holds part of the key: shardcast's writer "
                                  "needs every rank's plan; save over the whole group") from None
        layout = dataclasses.replace(layout, local=local)
        return [dataclasses.replace(p, storage_data=layout) for p in plans]

    @logged
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        if self._per_rank_files is not None:
            return self._per_rank_files.write_data(plan, planner)
        from .._group import _store_host, operation_store
        from .._load import _options
        from .._progress import _progress_printer
        from .._save import shard_size_text
        layout: _SaveLayout = plan.storage_data
        pg, rank, world, store = _group(run_group(self.process_group))
        if getattr(layout, "local", False):
            pg, rank, world, store = None, 0, 1, None
        options = _options(source=self.source, chunk_bytes=self.chunk_bytes, staging_slots=self.staging_slots,
                           timeout_ms=None if self.timeout is None else max(1, int(self.timeout * 1000)))
        progress = self.progress
        if progress is True:
            progress = _progress_printer("save") if rank == 0 else None
        elif progress is False:
            progress = None
        problem, entries, table = None, [], []
        try:  # anything that fails here is agreed in the save's first verdict: every rank raises it
            if not isinstance(layout, _SaveLayout):
                raise InvalidArgument(f"this rank's save plan carries {type(layout).__name__}, not shardcast's layout: "
                                      f"HuggingFaceStorageWriter.prepare_global_plan did not run on the coordinator")
            numbers = _file_numbers(self.fqn_to_index_mapping)
            entries, table = _local_entries(layout, plan.items, planner, rank), layout.layouts
            shard_size = shard_size_text(self.max_shard_size)
        except Exception as e:  # noqa: BLE001 -- any failure here must reach every rank, not only this one
            kind = type(e).__name__ if isinstance(e, ShardcastError) else "InternalError"
            problem = (kind, str(e) if isinstance(e, ShardcastError) else f"{type(e).__name__}: {e}")
            entries, table, numbers, shard_size = [], [], {}, "5GB"
        self.report = _shardcast.save_entries(
            entries, table, self.path, options, None, shard_size, True, "", "",
            operation_store(pg, store), rank, world, progress, problem,
            _store_host(store) if store is not None else "", file_numbers=numbers, keep_other_files=True,
            numbered_files=True)
        results = [WriteResult(index=item.index, size_in_bytes=_nbytes(item), storage_data=None)
                   for item in plan.items]
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        """Nothing to do: the files and the index were committed together in write_data."""
        if self._per_rank_files is not None:
            self._per_rank_files.finish(metadata, results)

    @property
    def metadata_path(self) -> str:
        if self._per_rank_files is not None:
            return self._per_rank_files.metadata_path
        return "model.safetensors.index.json"


def _file_numbers(mapping: Optional[Dict[str, int]]) -> Dict[str, int]:
    """fqn_to_index_mapping as {key: file number}, each a whole number (InvalidArgument naming the key: a
    float or text was truncated or raised a bare ValueError on one rank, outside the save's agreement)."""
    if mapping is None:
        return {}
    if not isinstance(mapping, dict):
        raise InvalidArgument(f"fqn_to_index_mapping must be a dict of key -> file number, not {type(mapping).__name__}")
    import operator
    out = {}
    for k, v in mapping.items():
        try:
            if not isinstance(k, str) or isinstance(v, bool):
                raise TypeError
            out[k] = operator.index(v)  # an int, or a numpy integer; never a float or text
        except TypeError:
            raise InvalidArgument(f"fqn_to_index_mapping[{k!r}] = {v!r}: each key must be a str and each file "
                                  "number an int") from None
    return out


def _mapping_digest(mapping: Optional[Dict[str, int]]) -> Tuple[int, str]:
    """(keys, digest) of a rank's fqn_to_index_mapping, for the coordinator to match every rank's."""
    import hashlib
    import operator

    def number(v):  # 1 and numpy's int64(1) alike; anything else as written (_file_numbers refuses it)
        try:
            return repr(operator.index(v)) if not isinstance(v, bool) else repr(v)
        except TypeError:
            return repr(v)
    items = sorted((repr(k), number(v)) for k, v in (mapping or {}).items()) if isinstance(mapping, dict) else [repr(mapping)]
    return len(items), hashlib.sha256(repr(items).encode()).hexdigest()[:16]


def _nbytes(item: WriteItem) -> int:
    if item.tensor_data is None:
        return 0
    n = 1
    for s in item.tensor_data.chunk.sizes:
        n *= s
    return n * item.tensor_data.properties.dtype.itemsize


def _ordered_keys(plans: List[SavePlan]) -> List[str]:
    """Every key once, in the state dict's order: each rank's plan lists its items in that order, but DCP's
    planner kept each replicated item on one rank only, so no one plan has them all. A key first seen in a
    later plan goes right after the key before it there (plan 0: a c d, plan 1: a b -> a b c d)."""
    after: Dict[Optional[str], List[str]] = {}
    seen = set()
    for plan in plans:
        prev = None
        for item in plan.items:
            key = item.index.fqn
            if key not in seen:
                seen.add(key)
                following = after.setdefault(prev, [])
                following.insert(len(following) if prev is None else 0, key)  # a plan's first key: after the rest
            prev = key
    out, stack = [], list(reversed(after.get(None, [])))
    while stack:  # depth first: a key, then what came right after it
        key = stack.pop()
        out.append(key)
        stack.extend(reversed(after.get(key, [])))
    return out


def _global_layout(plans: List[SavePlan]) -> _SaveLayout:
    """The coordinator's decision (see the module's doc): every key's global shape, dtype and boxes."""
    from .._layouts import _Layouts
    shapes: Dict[str, Tuple[Tuple[int, ...], torch.dtype, int]] = {}
    boxes: Dict[str, List[Tuple[int, Tuple[int, ...], Tuple[int, ...]]]] = {}
    not_tensors: List[str] = []
    for rank, plan in enumerate(plans):
        for item in plan.items:
            key = item.index.fqn
            if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
                not_tensors.append(key)
                continue
            td = item.tensor_data
            shape, dtype = tuple(int(s) for s in td.size), td.properties.dtype
            first = shapes.setdefault(key, (shape, dtype, rank))
            if first[:2] != (shape, dtype):
                raise InvalidArgument(f"key '{key}': rank {first[2]} saves it as {list(first[0])} {first[1]} but rank "
                                      f"{rank} as {list(shape)} {dtype}")
            offsets, sizes = tuple(int(o) for o in td.chunk.offsets), tuple(int(s) for s in td.chunk.sizes)
            mine = boxes.setdefault(key, [])
            if any(r == rank for r, _, _ in mine):
                raise Unsupported(f"key '{key}': rank {rank} saves several chunks of it (a ShardedTensor with several "
                                  f"local shards); shardcast writes one box per rank and tensor")
            if all(sizes):  # an empty chunk writes nothing: that rank is left out of the layout
                mine.append((rank, offsets, sizes))
    if not_tensors:
        raise InvalidArgument(f"'{not_tensors[0]}' is not a tensor (DCP would store it as pickled bytes)"
                              + (f", nor are {len(not_tensors) - 1} more" if len(not_tensors) > 1 else "")
                              + ": a Hugging Face checkpoint holds tensors only; leave it out of the state dict, or "
                              "save it with torch's FileSystemWriter")
    layouts = _Layouts()
    keys = []
    for key in _ordered_keys(plans):
        shape, dtype, _ = shapes[key]
        held = boxes[key]
        _check_cover(key, shape, held)
        if not held:  # a tensor of no elements: nothing to write, every rank passes an empty one
            keys.append((key, shape, dtype, -1))
            continue
        layout = ((), tuple(r for r, _, _ in held), (), tuple((o, s) for _, o, s in held))
        keys.append((key, shape, dtype, layouts.index(layout)))
    return _SaveLayout(keys=tuple(keys), layouts=layouts.table)


def _check_cover(key: str, shape: Tuple[int, ...], held) -> None:
    """The distinct boxes of a key cover it exactly: each element once (identical boxes are replicas,
    written once by the lowest rank)."""
    why = cover_problem(shape, sorted({(tuple(o), tuple(s)) for _, o, s in held}))
    if why is not None:
        raise InvalidArgument(f"key '{key}' of shape {list(shape)}: {why}; every element must be saved by exactly one "
                              f"chunk")


def _local_entries(layout: _SaveLayout, items: List[WriteItem], planner: SavePlanner, rank: int) -> list:
    """save_entries' entries on this rank: its chunk of every key it writes, an empty tensor for the others."""
    mine = {item.index.fqn: item for item in items if item.type != WriteItemType.BYTE_IO}
    entries = []
    for key, shape, dtype, index in layout.keys:
        item = mine.get(key)
        sizes = None if item is None else tuple(int(s) for s in item.tensor_data.chunk.sizes)
        if index == -1:
            local = torch.empty(shape, dtype=dtype)
        elif item is None or not all(sizes):
            local = torch.empty((0,) * len(shape), dtype=dtype)
        else:
            local = planner.resolve_data(item)
            if not isinstance(local, torch.Tensor):
                raise InvalidArgument(f"key '{key}': the planner resolved it to {type(local).__name__}, not a tensor")
            local = local.detach()
            if tuple(local.shape) != sizes:
                raise InvalidArgument(f"key '{key}' on rank {rank}: the planner resolved a tensor of shape "
                                      f"{list(local.shape)} for a chunk of {list(sizes)}")
            if not local.is_contiguous():
                local = local.contiguous()
        entries.append((key, local, list(shape), "parameter", index, None))
    return entries
