"""HuggingFaceStorageReader: torch's HF reader's surface, shardcast's engine underneath (the quantized reader,
its subclass, is in _hf_quantized.py).

DCP's load runs four steps on every rank; each is served here as follows:

  read_metadata        rank 0 opens the checkpoint once with shardcast's validating reader (index, headers,
                       names beneath the root); every rank receives the same key/dtype/shape/file list
                       through the group's store and builds exactly the Metadata torch's reader builds
  prepare_global_plan  the coordinator sees every rank's ReadItems; each becomes a box of its key's global
                       tensor held by its rank (one "round" per read item of a key on a rank: one round in
                       every layout DCP's default planner makes of an HF checkpoint), and every rank gets
                       the whole table in its plan
  read_data            one shardcast load per round over the table: the manifest agreed by every rank, then
                       each rank's boxes streamed through the bounded staging ring (any box: rows, columns,
                       inner blocks) straight into the planner's destination tensors; fp8 weights, MXFP4
                       blocks and NVFP4 are dequantized in the stream by the quantized reader
  (any failure)        the same ShardcastError on every rank within the timeout, which DCP then reports
                       as its CheckpointException on every rank

A directory of torch's per-rank files (HuggingFaceStorageWriter(save_distributed=True) without its
consolidation: "shard-0000r-model-0000k-of-0000n.safetensors", each tensor's piece placed by the file's
DCP_SHARDING_INFO) is read as torch's reader reads it: each key has one chunk per file holding a piece of it,
and each file is a round of its own.

A destination that is contiguous and of the checkpoint's (or the dequantized) dtype is written in place;
any other (a strided view, another dtype) receives a contiguous copy of its box, converted with copy_, as
torch's reader converts.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader as _TorchReader
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from .. import _shardcast
from .._group import _group, _store_host, operation_store
from .._layouts import _Layouts
from .._load import _options
from .._shardcast import InvalidArgument, ShardcastError
from ._agree import alone as _alone, dcp_run, group_problem, logged, on_rank0, run_group
from ._hf_files import pieces_by_file

try:
    from torch.distributed.checkpoint._hf_utils import _HFStorageInfo
except ImportError:  # pragma: no cover -- every torch with hf_storage has it
    _HFStorageInfo = None

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "C64": torch.complex64,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("F8_E8M0", "float8_e8m0fnu")):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)

_PLAN_KEY = "shardcast.dcp/boxes"  # the plan's storage_data: {this key: [round: {fqn: its boxes' number}]}
_BOXES = "shardcast.dcp/box-lists"  # and {this key: [number: [(rank, offsets, lengths)]]}, each list once
_ROUND_FILES = "shardcast.dcp/files"  # and {this key: [round: (its file, "" for the checkpoint; j)]}
_ALONE = "shardcast.dcp/alone"  # and {this key: whether this rank reads alone (dcp.load(no_dist=True) on it)}


def _torch_dtype(name: str, key: str, file: str) -> torch.dtype:
    dtype = _DTYPES.get(name)
    if dtype is None:
        raise _shardcast.Unsupported(f"key '{key}' in {file}: dtype {name} has no torch equivalent")
    return dtype


class HuggingFaceStorageReader(_TorchReader):
    """`torch.distributed.checkpoint.HuggingFaceStorageReader`, served by shardcast.

        dcp.load(state_dict, storage_reader=shardcast.dcp.HuggingFaceStorageReader(path))

    `path`: a Hugging Face checkpoint directory (model.safetensors.index.json and its files, or
    model.safetensors), one .safetensors file, or a directory of the per-rank files torch's
    `HuggingFaceStorageWriter(save_distributed=True)` writes before (or without) its consolidation. `thread_count` is accepted for torch's signature; the
    engine sizes its own reading (`read_threads`). shardcast's options, keyword-only, as in `shardcast.load` (None: the
    SHARDCAST_* variable, else the default): `source` ("auto", "each-rank", "rank0", "node-leader",
    "striped"), `chunk_bytes`, `staging_slots`, `readahead_bytes`, `read_threads`, `timeout` (seconds per collective and
    per store wait), `verify`; `process_group` (the group `dcp.load` runs over; default: the
    process_group dcp.load was given, else the default group). Under `dcp.load(no_dist=True)` this rank
    reads the headers itself: no other rank loads with it.

    Collective where torch.distributed runs: every rank of the group calls read_metadata and read_data
    together, as dcp.load does. After read_data, `last_report` holds this rank's report of each round.
    """

    def __init__(self, path: Union[str, os.PathLike], thread_count: int = 1, *, source: Optional[str] = None,
                 chunk_bytes: Optional[Union[int, str]] = None, staging_slots: Optional[int] = None,
                 readahead_bytes: Optional[Union[int, str]] = None, read_threads: Optional[int] = None,
                 timeout: Optional[float] = None,
                 verify: Optional[bool] = None, process_group=None) -> None:
        super().__init__(path=os.fspath(path), thread_count=thread_count)
        self._shardcast_options = _options(
            source=source, chunk_bytes=chunk_bytes, staging_slots=staging_slots, readahead_bytes=readahead_bytes,
            read_threads=read_threads,
            verify=verify, timeout_ms=None if timeout is None else max(1, int(timeout * 1000)))
        self._process_group = process_group
        self._shapes: Dict[str, Tuple[int, ...]] = {}
        self._dtypes: Dict[str, torch.dtype] = {}   # what the engine delivers for each key
        # per-rank files only: (fqn, piece offsets) -> its file, and (fqn, file) -> the piece's shape
        self._chunks: Optional[Dict[Tuple[str, Tuple[int, ...]], str]] = None
        self._pieces: Dict[Tuple[str, str], Tuple[int, ...]] = {}
        self._read_by_file: Optional[bool] = None  # read_metadata's answer: rank 0's, where ranks read together
        self.last_report: Optional[List[dict]] = None

    # -- metadata -----------------------------------------------------------------------------------------
    def _timeout_s(self) -> float:
        return _shardcast.load_timeout_seconds(self._shardcast_options)

    def _by_file(self) -> bool:
        """Whether the checkpoint is read file by file, as torch's reader reads every directory: a directory
        of safetensors files with no index and no model.safetensors (torch's per-rank files, an adapter, a
        sharded model whose index is missing). Otherwise it is read whole, by its index."""
        path = os.fspath(self.path)
        return os.path.isdir(path) and not any(os.path.exists(os.path.join(path, name)) for name in
                                               ("model.safetensors.index.json", "model.safetensors"))

    def _scan(self) -> Dict[str, Any]:
        """{"by_file": whether the checkpoint is read file by file, "tensors": [[key, dtype name, shape, file,
        offsets]] of every tensor (of every piece, read file by file)}, by the loader's validating reader;
        offsets is None for a whole tensor of a checkpoint read whole."""
        path = os.fspath(self.path)
        if self._by_file():
            pieces = pieces_by_file(path)
            if pieces:
                return {"by_file": True, "tensors": pieces}
        return {"by_file": False,
                "tensors": [[k, d, list(s), f, None] for k, d, s, f in _shardcast.checkpoint_tensors(path)]}

    def _group_arg(self):
        """The group this load runs over: the reader's process_group, else the one dcp.load was given."""
        return run_group(self._process_group)

    def _tensors(self) -> Dict[str, Any]:
        run = dcp_run()
        if run is None or not run[0]:
            # dcp.load(no_dist=True), or a call outside DCP (transformers' consolidation asks rank 0 alone; a
            # script inspecting the keys, as torch's reader allows, any rank): no other rank reads with this
            # one, so it reads for itself.
            return self._scan()
        # rank 0's reading, whatever path each rank names its copy by: read_data's agreement catches a copy
        # that differs. Whether to read file by file is rank 0's answer too, so every rank plans the same
        # rounds, and a copy missing a file (its index, model.safetensors) is the load's to serve or refuse.
        # Over DCP's own group, whatever each reader was given: a rank 0 given another group tells every
        # rank so through this exchange; another rank takes rank 0's answer (keeping the exchanges numbered
        # in step) and raises, and DCP's gather after this step tells the others.
        problem = group_problem(self._process_group, run[1])
        problem = problem and f"{os.fspath(self.path)}: {problem}"

        def scan():
            if problem is not None:
                raise InvalidArgument(problem)
            return self._scan()
        result = on_rank0(run[1], scan, self._timeout_s(), "the checkpoint's headers")
        if problem is not None:
            raise InvalidArgument(problem)
        return result

    @logged
    def read_metadata(self) -> Metadata:
        """The Metadata torch's reader builds (one whole-tensor chunk per key, the file's dtype and shape),
        from one reading of the checkpoint by rank 0. No keyword arguments, as torch's: DCP then does not
        retry with `rank=` (rank-local metadata, which an HF checkpoint has not) after an agreed failure."""
        state_dict_metadata: Dict[str, TensorStorageMetadata] = {}
        storage_data: Dict[MetadataIndex, Any] = {}
        scan = self._tensors()
        self._read_by_file = scan["by_file"]
        for key, dtype_name, shape, file, offsets in scan["tensors"]:
            dtype = _torch_dtype(dtype_name, key, file)
            size = torch.Size(shape)
            offsets = list(offsets) if offsets is not None else [0] * len(shape)
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=size)
            md = state_dict_metadata.get(key)
            if md is None:
                state_dict_metadata[key] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=dtype), size=torch.Size(o + n for o, n in zip(offsets, shape)),
                    chunks=[chunk])
            else:  # another piece of it (per-rank files): the tensor spans every piece
                md.chunks.append(chunk)
                md.size = torch.Size(max(a, o + n) for a, o, n in zip(md.size, offsets, shape))
            storage_data[MetadataIndex(fqn=key, offset=offsets)] = (
                _HFStorageInfo(relative_path=file, shape=size, dtype=dtype) if _HFStorageInfo else file)
        metadata = Metadata(state_dict_metadata=state_dict_metadata, storage_data=storage_data)
        metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        self._adjust_metadata(metadata)
        return metadata

    def _adjust_metadata(self, metadata: Metadata) -> None:
        """The plain reader delivers every key as stored."""

    def _delivered_dtype(self, key: str, stored: torch.dtype) -> torch.dtype:
        return stored

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data
        self.is_coordinator = is_coordinator
        self._shapes = {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items()
                        if isinstance(v, TensorStorageMetadata)}
        self._dtypes = {k: self._delivered_dtype(k, v.properties.dtype)
                        for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
        self._chunks = None
        # read_metadata's answer (rank 0's); this rank's own only for metadata this reader did not read
        by_file = self._read_by_file if self._read_by_file is not None else self._by_file()
        if by_file:
            self._chunks, self._pieces = {}, {}
            for index, info in (metadata.storage_data or {}).items():
                file = getattr(info, "relative_path", info)
                self._chunks[(index.fqn, tuple(int(x) for x in index.offset))] = file
                self._pieces[(index.fqn, file)] = tuple(int(x) for x in info.shape)

    # -- plans --------------------------------------------------------------------------------------------
    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        """Every rank's read items as boxes of their keys: round j holds each rank's j-th item of a key (in
        per-rank files, round j is the j-th file and its boxes are in its pieces' coordinates)."""
        by_round: Dict[Tuple[str, int], Dict[str, list]] = {}
        for rank, plan in enumerate(plans):
            for at, by_key in self._rounds_of(plan.items).items():
                boxes = by_round.setdefault(at, {})
                for fqn, item in by_key.items():
                    boxes.setdefault(fqn, []).append(
                        (rank, [int(x) for x in item.storage_offsets], [int(x) for x in item.lengths]))
        # every plan carries the whole table, so each list of boxes goes in once: keys of one shape in one
        # layout (every layer's) share theirs, and the table grows with the keys, not keys x ranks
        lists: Dict[tuple, int] = {}
        numbered = [{fqn: lists.setdefault(tuple((r, tuple(o), tuple(n)) for r, o, n in held), len(lists))
                     for fqn, held in by_round[at].items()} for at in sorted(by_round)]
        data = {_PLAN_KEY: numbered, _BOXES: list(lists), _ROUND_FILES: [list(at) for at in sorted(by_round)],
                _ALONE: _alone(plans, self._group_arg())}
        return [dataclasses.replace(plan, storage_data=data) for plan in plans]

    def _rounds_of(self, items) -> Dict[Tuple[str, int], Dict[str, Any]]:
        """One rank's read items by round, (file, j) -> {fqn: item}: round j of a file holds the j-th item of
        each key read from it. The file is "" for a checkpoint read whole (one round in every layout DCP's
        default planner makes of an HF checkpoint, whose keys are one chunk each), else the per-rank file
        holding the item's piece."""
        rounds: Dict[Tuple[str, int], Dict[str, Any]] = {}
        seen: Dict[Tuple[str, str], int] = {}
        for item in items:
            index = item.storage_index
            file = "" if self._chunks is None else self._chunks[(index.fqn, tuple(int(x) for x in index.offset))]
            j = seen[(file, index.fqn)] = seen.get((file, index.fqn), -1) + 1
            rounds.setdefault((file, j), {})[index.fqn] = item
        return rounds

    # -- data ---------------------------------------------------------------------------------------------
    @logged
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        pg, rank, world, store = _group(self._group_arg())
        if isinstance(plan.storage_data, dict) and plan.storage_data.get(_ALONE):
            pg, rank, world, store = None, 0, 1, None
        table = plan.storage_data.get(_PLAN_KEY) if isinstance(plan.storage_data, dict) else None
        at = [tuple(a) for a in plan.storage_data.get(_ROUND_FILES, [])] if table is not None else []
        mine = self._rounds_of(plan.items)
        problem = None
        if table is None or len(at) != len(table):
            problem = ("InvalidArgument", f"rank {rank}: the load plan carries no boxes from shardcast's "
                       "prepare_global_plan (a planner dropped the plan's storage_data?)")
            table, at = [{}], [("", 0)]
        elif set(mine) - set(at):
            problem = ("InternalError", f"rank {rank}: read rounds {sorted(set(mine) - set(at))} planned here, "
                       "not globally")
        reports = []
        lists = plan.storage_data.get(_BOXES, []) if table is not None else []
        for numbers, (file, j) in zip(table, at):
            boxes = {fqn: lists[n] for fqn, n in numbers.items()} if problem is None else {}
            reports.append(self._read_round(boxes, mine.get((file, j), {}), planner, pg, rank, world, store,
                                            problem, file or None))
        self.last_report = reports
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_round(self, boxes: Dict[str, list], items: Dict[str, Any], planner: LoadPlanner, pg, rank: int,
                    world: int, store, problem, file: Optional[str] = None) -> dict:
        """One shardcast load of every key in `boxes` (each rank's box of it), into this rank's items: from
        the checkpoint, or from one of its per-rank files (`file`, each key's piece there as its tensor)."""
        entries, layouts, copies = [], _Layouts(), []
        options = dict(self._shardcast_options)
        try:
            if problem is not None:
                raise _shardcast.InternalError(problem[1])
            devices = set()
            for fqn in sorted(boxes):
                held = boxes[fqn]
                if fqn not in self._shapes:
                    raise InvalidArgument(f"key '{fqn}' is planned but not in the checkpoint's metadata")
                shape, dtype = self._shapes[fqn], self._dtypes[fqn]
                if file is not None:
                    shape = self._piece_shape(fqn, file)
                key, swap = self._engine_key(fqn)
                if swap:  # the engine's MXFP4 layout is [..., in, out]: the same box, its last two dims swapped
                    shape = _swapped(shape)
                    held = [(r, _swapped(o), _swapped(n)) for r, o, n in held]
                layout = ((), tuple(r for r, _, _ in held), (),
                          tuple((tuple(o), tuple(n)) for _, o, n in held))
                item = items.get(fqn)
                if item is None:
                    local = torch.empty([0] * len(shape), dtype=dtype)
                else:
                    local = self._destination(item, planner, dtype, rank, copies, swap)
                    devices.add(local.device)
                entries.append((key, local, list(shape), "parameter", layouts.index(layout), None))
            cuda = [d for d in devices if d.type == "cuda"]
            if cuda:
                if len(devices) > 1:
                    raise InvalidArgument(f"rank {rank}: destinations on several devices ({sorted(map(str, devices))})")
                options["target"] = "cuda"
                entries = [(k, t if t.device == cuda[0] else t.to(cuda[0]), *rest) for k, t, *rest in entries]
            elif not devices and _state_dict_on_cuda(planner):
                # Nothing of this round lands here, yet the state dict is on the GPU: the target (and with it the
                # staging defaults, which rank 0's options fix for every rank) is the GPU's all the same.
                options["target"] = "cuda"
        except Exception as e:  # noqa: BLE001 -- carried into the agreement: every rank raises it
            kind = type(e).__name__ if isinstance(e, ShardcastError) else "InternalError"
            problem = (kind, str(e) if isinstance(e, ShardcastError) else f"rank {rank}: {type(e).__name__}: {e}")
            entries, layouts, copies = [], _Layouts(), []
        source = os.fspath(self.path) if file is None else os.path.join(os.fspath(self.path), os.path.basename(file))
        report = _shardcast.load_entries(entries, layouts.table, source, options, {},
                                         operation_store(pg, store), rank, world, None, problem,
                                         _store_host(store) if store is not None else "")
        for item, dest, staged, swap in copies:
            if staged is not None:
                staged = self._delivered(item.storage_index.fqn, staged)
                dest.copy_(staged.transpose(-1, -2) if swap else staged)
            else:  # written in place: as delivered there too
                delivered = self._delivered(item.storage_index.fqn, dest)
                if delivered is not dest:
                    dest.copy_(delivered)
            planner.commit_tensor(item, dest)
        return report

    def _delivered(self, fqn: str, staged: torch.Tensor) -> torch.Tensor:
        """A box as the reader delivers it (staged, before it is copied into its destination, or written in
        place): as read."""
        return staged

    def _piece_shape(self, fqn: str, file: str) -> Tuple[int, ...]:
        shape = self._pieces.get((fqn, file))
        if shape is None:
            raise InvalidArgument(f"key '{fqn}' is planned from {file}, which holds no piece of it")
        return shape

    def _engine_key(self, fqn: str) -> Tuple[str, bool]:
        """The key the engine resolves for a checkpoint key, and whether its layout is the transpose of the
        key's last two dims. The plain reader reads every key as it is stored."""
        return fqn, False

    @staticmethod
    def _destination(item, planner: LoadPlanner, dtype: torch.dtype, rank: int, copies: list,
                     swap: bool = False) -> torch.Tensor:
        """The tensor the engine writes this item's box into: the planner's destination itself where it is
        contiguous and of the delivered dtype, else a contiguous staging copy (copied in after the load)."""
        dest = planner.resolve_tensor(item).detach()
        lengths = tuple(int(x) for x in item.lengths)
        if tuple(dest.shape) != lengths:
            raise InvalidArgument(f"rank {rank}: key '{item.storage_index.fqn}': the planner's destination is "
                                  f"{tuple(dest.shape)} but the read item is {lengths}")
        if dest.dtype == dtype and dest.is_contiguous() and not swap:
            copies.append((item, dest, None, False))
            return dest
        staged = torch.empty(_swapped(lengths) if swap else lengths, dtype=dtype, device=dest.device)
        copies.append((item, dest, staged, swap))
        return staged


def _state_dict_on_cuda(planner) -> bool:
    """Whether the planner's state dict (DefaultLoadPlanner's, where it has one) holds a tensor on a GPU."""
    state = getattr(planner, "state_dict", None)
    return isinstance(state, dict) and any(isinstance(v, torch.Tensor) and v.device.type == "cuda"
                                           for v in state.values())


def _swapped(dims):
    """The last two dims exchanged."""
    dims = list(dims)
    return tuple(dims[:-2] + [dims[-1], dims[-2]])
