"""StorageReader: a training state StorageWriter wrote, behind dcp.load (the format: _state)."""
from __future__ import annotations

import dataclasses
import io
import json
import os
import sys
import uuid
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader as _TorchStorageReader
from torch.futures import Future

from .._shardcast import CheckpointError, InvalidArgument
from ._agree import logged
from ._state_codec import (DEFAULT_BLOCK_BYTES, DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_METADATA_BYTES, METADATA_NAME,
                           StoredItem, _rank, decode_metadata)
from ._state_files import _copy_box, _RankFile, open_regular
from ._state_values import decode_value


class StorageReader(_TorchStorageReader):
    """`torch.distributed.checkpoint.FileSystemReader`'s place, reading what StorageWriter wrote.

        dcp.load(state, storage_reader=shardcast.dcp.StorageReader(path))

    `_extension_registry` is accepted in torch's place and changes nothing (no transforms are written).
    Keyword-only options, with their defaults: `block_bytes` (64 MiB: the most file bytes a rank maps in
    before dropping them again, so RssFile stays bounded), `max_header_bytes` (100 MB: a rank file's
    header cap), `max_metadata_bytes` (4 GiB), `allow_pickle` (False: byte items the writer kept as
    torch.save bytes are refused, since unpickling them runs code from the checkpoint).

    read_metadata reads .metadata.json on every rank that calls it. A store exchange from rank 0 would
    save reads of one small file, but the reader is not told which group dcp.load runs over (a subgroup,
    no_dist, or one rank inspecting a checkpoint on its own), and a wait on a rank that is not loading is a
    hang until the timeout; a rank whose read fails raises in DCP's plan step, which reports it on every
    rank. The JSON is hostile input: sizes, chunk boxes, dtypes, file names (no path leaves the
    directory), every chunk stored exactly once with its exact byte length under its own key. Each rank's
    plan carries the save its metadata is (storage_meta.save_id): the coordinator refuses ranks that read
    different saves (a rank pointed at another step's folder), on every rank through DCP.

    read_data opens each rank file it needs once (a regular file, never waiting on a FIFO), validates its
    header (capped, every entry inside the file, the entries tiling the data, the save it names the
    metadata's), checks each item against it (key, offsets, dtype, shape), and
    copies the requested box straight from the mapped bytes into planner.resolve_tensor(item), block by
    block, dropping each block's pages (madvise DONTNEED) once copied. A destination of another dtype is
    converted by copy_, as torch's reader converts.
    """

    def __init__(self, path: Union[str, os.PathLike], _extension_registry=None, *, block_bytes: int = DEFAULT_BLOCK_BYTES,
                 max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
                 max_metadata_bytes: int = DEFAULT_MAX_METADATA_BYTES, allow_pickle: bool = False) -> None:
        super().__init__()
        if block_bytes < 1:
            raise InvalidArgument(f"block_bytes must be positive, not {block_bytes}")
        self.path = os.fspath(path)
        self.block_bytes, self.max_header_bytes, self.max_metadata_bytes, self.allow_pickle = (
            block_bytes, max_header_bytes, max_metadata_bytes, allow_pickle)
        self.load_id = uuid.uuid4().hex
        self.storage_data: Dict[MetadataIndex, StoredItem] = {}
        self._chunks: Dict[Tuple[str, Tuple[int, ...]], Tuple[torch.dtype, List[int]]] = {}
        self.rank: Optional[int] = None
        self.save_id: Optional[str] = None

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.load_id = uuid.uuid4().hex

    @logged
    def read_metadata(self, *args: Any) -> Metadata:
        # No **kwargs: DCP then never falls back to rank-local metadata (read_metadata(rank=r), for a save
        # without collectives, which StorageWriter refuses), where a rank that fails its read raises alone
        # while the others wait in DCP's closing barrier.
        path = os.path.join(self.path, METADATA_NAME)
        where = f"rank {_rank()}: {path}"
        fd = open_regular(path, f"{where}: cannot read the checkpoint's metadata (a directory without it is not a "
                                f"finished checkpoint)")
        try:
            size = os.fstat(fd).st_size
            if size > self.max_metadata_bytes:
                raise CheckpointError(f"{where}: {size} bytes, over the cap of {self.max_metadata_bytes}")
            with os.fdopen(os.dup(fd), "rb") as f:
                # its size and one byte more: a read of the whole cap would allocate it (4 GiB, refused under an
                # address-space limit), and a file that grows after fstat is still caught
                text = f.read(size + 1)
        except OSError as e:
            raise CheckpointError(f"{where}: cannot read the checkpoint's metadata ({e.strerror or e})") from e
        finally:
            os.close(fd)
        if len(text) > size:
            raise CheckpointError(f"{where}: it grew from {size} bytes as it was read (a save still writing it?)")
        md = decode_metadata(text, where)
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.rank = kwargs.get("rank", _rank())
        if not isinstance(metadata.storage_data, dict) or not all(
                isinstance(v, StoredItem) for v in metadata.storage_data.values()):
            raise CheckpointError(f"rank {self.rank}: {self.path}: the metadata's storage_data is not shardcast's")
        self.storage_data = metadata.storage_data
        self.save_id = metadata.storage_meta.save_id if metadata.storage_meta else None
        self._chunks = {(fqn, tuple(c.offsets)): (e.properties.dtype, list(c.sizes))
                        for fqn, e in metadata.state_dict_metadata.items() if isinstance(e, TensorStorageMetadata)
                        for c in e.chunks}

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # which save this rank's metadata is, for the coordinator to match (prepare_global_plan)
        return dataclasses.replace(plan, storage_data=(self.save_id, self.path))

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        """On the coordinator, with every rank's plan: every rank read the metadata of one save. Ranks may
        name their copies by their own paths, but a rank given another save (another step's folder) would
        load other values beside this rank's, silently: DCP raises this on every rank."""
        mine = (self.save_id, self.path)
        for r, p in enumerate(plans):
            theirs = p.storage_data if isinstance(p.storage_data, tuple) and len(p.storage_data) == 2 else (None, "?")
            if theirs[0] != mine[0]:
                raise CheckpointError(f"rank {r} read the metadata of save {theirs[0]} in {theirs[1]}, rank "
                                      f"{self.rank} of save {mine[0]} in {mine[1]}: every rank must load the same "
                                      f"checkpoint")
        return [dataclasses.replace(p, storage_data=None) for p in plans]

    def _by_file(self, plan: LoadPlan) -> Dict[str, List[Tuple[ReadItem, StoredItem]]]:
        per_file: Dict[str, List[Tuple[ReadItem, StoredItem]]] = {}
        for req in plan.items:
            item = self.storage_data.get(req.storage_index)
            if item is None:
                raise CheckpointError(f"rank {self.rank}: {self.path}: '{req.storage_index.fqn}' at "
                                      f"{req.storage_index.offset} is in no rank file")
            per_file.setdefault(item.file, []).append((req, item))
        for reqs in per_file.values():
            reqs.sort(key=lambda r: r[1].offset)  # one sweep through each file
        return per_file

    @logged
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        for name, reqs in self._by_file(plan).items():
            f = _RankFile(os.path.join(self.path, name), self.max_header_bytes, self.save_id)
            try:
                for req, item in reqs:
                    if req.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(req, self._value(f, req, item))
                    else:
                        self._tensor(f, req, item, planner)
            finally:
                f.close()
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _value(self, f: _RankFile, req: ReadItem, item: StoredItem) -> io.BytesIO:
        where = f"rank {self.rank}: {f.path}: byte item '{item.key}'"
        f.locate(item.key, item, torch.uint8, [item.length])
        raw = f.read_bytes(item.offset, item.length, f"byte item '{item.key}'")
        if item.encoding == "torch.save":
            if not self.allow_pickle:
                raise CheckpointError(f"{where}: stored as torch.save bytes (a pickle); pass allow_pickle=True "
                                      f"to the reader if this checkpoint is trusted")
            return io.BytesIO(raw)
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise CheckpointError(f"{where}: not JSON ({type(e).__name__}: {e})") from e
        out = io.BytesIO()
        try:  # decoding recurses as deep as the value nests, and a hostile file nests it past any stack
            torch.save(decode_value(doc, where), out)
        except RecursionError:
            raise CheckpointError(f"{where}: the value nests too deep to decode within Python's recursion limit "
                                  f"({sys.getrecursionlimit()})") from None
        out.seek(0)
        return out

    def _tensor(self, f: _RankFile, req: ReadItem, item: StoredItem, planner: LoadPlanner) -> None:
        index = req.storage_index
        dtype, chunk = self._chunks[(index.fqn, tuple(index.offset))]
        base = f.locate(item.key, item, dtype, chunk)
        offsets, lengths = list(req.storage_offsets), list(req.lengths)
        if len(offsets) != len(chunk) or any(o + n > c for o, n, c in zip(offsets, lengths, chunk)):
            raise CheckpointError(f"rank {self.rank}: {f.path}: tensor '{item.key}': the plan asks for "
                                  f"{lengths} at {offsets}, outside the stored chunk {chunk}")
        dest = planner.resolve_tensor(req).detach()
        if list(dest.shape) != lengths:
            raise CheckpointError(f"rank {self.rank}: {f.path}: tensor '{item.key}': the destination is "
                                  f"{list(dest.shape)}, the plan asks for {lengths}")
        _copy_box(f, base, dtype, chunk, offsets, lengths, dest, self.block_bytes, f"tensor '{item.key}'")
        planner.commit_tensor(req, dest)

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        try:
            return os.path.isfile(os.path.join(os.fspath(checkpoint_id), METADATA_NAME))
        except TypeError:
            return False
