"""StorageWriter: a whole training state behind dcp.save, as safetensors plus JSON (the format: _state)."""
from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import re
import uuid
from typing import Any, List, Optional, Tuple, Union

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter as _TorchStorageWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .._shardcast import CheckpointError, InternalError, InvalidArgument, IoError, Unsupported, fault_point
from ._agree import logged
from ._state_codec import (_CODE_OF, _FILE_RE, DEFAULT_BLOCK_BYTES, FORMAT, METADATA_NAME, StoredItem, _fsync_dir,
                           _name_of, _rank, chunk_key, encode_metadata)
from ._state_files import _bins, _header_bytes, _write_all, _write_tensor
from ._state_values import _weights_only_load, encode_value

_TORCH_FILE_RE = re.compile(r"^__[0-9]{1,9}_[0-9]{1,9}\.distcp$")  # torch's FileSystemWriter's rank files


class StorageWriter(_TorchStorageWriter):
    """`torch.distributed.checkpoint.FileSystemWriter`'s place, writing safetensors and JSON.

        dcp.save(state, storage_writer=shardcast.dcp.StorageWriter(path))

    `path`: the checkpoint directory (created). Then torch's positional arguments, in its order:
    single_file_per_rank, sync_files, thread_count, per_thread_copy_ahead, cache_staged_state_dict,
    overwrite, _extensions, serialization_format; single_file_per_rank, per_thread_copy_ahead,
    cache_staged_state_dict and serialization_format are accepted and change nothing (every rank writes one
    safetensors file), and _extensions (compression) is Unsupported. Their meanings, with the defaults:
    `overwrite` (True, as torch's: an existing checkpoint in `path` is replaced; its metadata is removed
    before any rank writes, so an interrupted overwrite leaves no checkpoint rather than a mixed one),
    `sync_files` (True: every rank file, the metadata and the directory are fsynced), `block_bytes` (64 MiB:
    the largest piece staged from a device or handed to one write), `thread_count` (1, as torch's: threads
    writing this rank's items into its one file side by side, each at its offset); keyword-only, shardcast's:
    `allow_pickle` (False: see the module's doc), `block_bytes`.

    Each rank writes one file, __<rank>_0.safetensors: its header first (every item's dtype, shape and
    offsets come from the plan, and the save's id, which the reader matches against the metadata's), then
    each item at its offset (pwrite) as the planner resolves it, one at a time per thread. The coordinator
    writes .metadata.json in finish(), last and atomically, and removes rank files of an
    earlier save in `path` that the new metadata does not name. A checkpoint torch's FileSystemWriter
    wrote in `path` (.metadata, __<r>_<n>.distcp) is replaced as one of shardcast's is: refused with
    overwrite=False, else its metadata removed before any rank writes and its rank files after.
    `dcp.save(..., use_collectives=False)` (torch's experimental rank-local metadata) is Unsupported.
    """

    def __init__(self, path: Union[str, os.PathLike], single_file_per_rank: bool = True, sync_files: bool = True,
                 thread_count: int = 1, per_thread_copy_ahead: int = 10_000_000, cache_staged_state_dict: bool = False,
                 overwrite: bool = True, _extensions=None, serialization_format=None, *,
                 block_bytes: int = DEFAULT_BLOCK_BYTES, allow_pickle: bool = False) -> None:
        super().__init__()
        if _extensions:  # torch's stream transforms (compression) would change bytes a reader must undo
            raise Unsupported("StorageWriter writes plain safetensors: _extensions (stream transforms) are not "
                              "supported")
        if block_bytes < 1 or thread_count < 1:
            raise InvalidArgument(f"block_bytes and thread_count must be positive, not {block_bytes}, {thread_count}")
        self.path = os.fspath(path)
        self.thread_count = thread_count
        self.overwrite, self.sync_files, self.block_bytes, self.allow_pickle = (
            overwrite, sync_files, block_bytes, allow_pickle)
        self.save_id = uuid.uuid4().hex
        self.rank: Optional[int] = None
        self.is_coordinator = False
        self.use_collectives = True
        self._written_save_id: Optional[str] = None  # the id this rank's file names (its final plan's)

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.save_id = uuid.uuid4().hex
        self._written_save_id = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank", _rank())
        self.use_collectives = kwargs.get("use_collectives", True)

    def _metadata_path(self) -> str:
        return os.path.join(self.path, METADATA_NAME)

    def _metadata_paths(self) -> List[str]:
        """This save's metadata file, and torch's FileSystemWriter's in its place (".metadata"): a checkpoint
        torch wrote in `path` is one this save replaces, else torch's reader (dcp.load(checkpoint_id=path))
        would go on reading the old one."""
        ours = self._metadata_path()
        return [ours, ours[: -len(".json")]]

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as e:
            raise IoError(f"rank {self.rank}: cannot create {self.path}: {e.strerror or e}") from e
        held = [p for p in self._metadata_paths() if os.path.exists(p)]
        if held and not self.overwrite:
            raise CheckpointError(f"rank {self.rank}: {self.path} already holds a checkpoint ({held[0]}) and "
                                  "overwrite=False")
        if not self.use_collectives:
            # Every rank would plan alone and write metadata of its own pieces only: a checkpoint that no
            # other layout can read, and whose load DCP runs without the collectives that carry one rank's
            # failure to the others (it fails alone while they wait in DCP's closing barrier).
            raise Unsupported(f"rank {self.rank}: StorageWriter needs DCP's collectives (one plan, one metadata "
                              "for the whole state): save with use_collectives=True, the default")
        return plan

    def _forget_metadata(self) -> None:
        held = [p for p in self._metadata_paths() if os.path.exists(p)]
        for p in held:
            os.unlink(p)
        if held and self.sync_files:
            _fsync_dir(self.path)

    def prepare_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
        # Before any rank writes (write_data follows this step), so an overwrite cut short looks unfinished.
        self._forget_metadata()
        if not any(getattr(p, "usable", True) for p in plans):
            # DCP's plan cache (DefaultSavePlanner(enable_plan_caching=True), the state's structure unchanged):
            # every rank writes by its cached final plan, the first cached save's prefix and id, and finish()
            # writes the id the coordinator's plan carried
            return plans
        if not all(getattr(p, "usable", True) for p in plans):
            raise Unsupported("a save plan cached on some ranks only (DefaultSavePlanner(enable_plan_caching=True) "
                              "after the state's structure changed on some ranks): their rank files would name "
                              "another save than the others'; save without plan caching")
        # each rank's file prefix, and the save every rank file names (its header's __metadata__ save_id,
        # the metadata's storage_meta.save_id): the reader refuses a rank file of another save
        return [dataclasses.replace(p, storage_data=(f"__{i}_", self.save_id)) for i, p in enumerate(plans)]

    def _byte_item(self, item: WriteItem, planner: SavePlanner) -> Tuple[bytes, str]:
        data = planner.resolve_data(item)
        raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
        where = f"rank {self.rank}: '{item.index.fqn}'"
        try:
            value = _weights_only_load(raw)
        except Exception as e:  # noqa: BLE001 -- the weights-only unpickler refuses any other class
            if self.allow_pickle:
                return raw, "torch.save"
            found = re.search(r"GLOBAL ([\w.]+)", str(e))
            what = f"a value of class {found.group(1)}" if found else f"{type(e).__name__}: {str(e)[:200]}"
            raise Unsupported(f"{where}: not plain data ({what}); convert it, or pass allow_pickle=True to the "
                              "writer and reader to keep it as torch.save bytes") from e
        try:
            return json.dumps(encode_value(value, where), allow_nan=False, separators=(",", ":")).encode(), "json"
        except Unsupported:
            if self.allow_pickle:
                return raw, "torch.save"
            raise

    @logged
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        prefix, save_id = plan.storage_data
        self._written_save_id = save_id  # the coordinator's finish() names it in the metadata
        name = f"{prefix}0.safetensors"
        path = os.path.join(self.path, name)
        # Byte items are small and their length is known only once encoded: first. Tensors stream after.
        blobs = {id(it): self._byte_item(it, planner) for it in plan.items if it.type == WriteItemType.BYTE_IO}
        layout = []  # (item, key, code, shape, length)
        for it in plan.items:
            if it.type == WriteItemType.BYTE_IO:
                blob = blobs[id(it)][0]
                layout.append((it, it.index.fqn, "U8", [len(blob)], len(blob)))
            else:
                td = it.tensor_data
                where = f"rank {self.rank}: '{it.index.fqn}'"
                _name_of(td.properties.dtype, where)
                shape = list(td.chunk.sizes)
                key = chunk_key(it.index.fqn, td.chunk.offsets)
                layout.append((it, key, _CODE_OF[td.properties.dtype], shape,
                               math.prod(shape) * td.properties.dtype.itemsize))
        if len({k for _, k, _, _, _ in layout}) != len(layout):
            raise InternalError(f"rank {self.rank}: two items of the plan have the same key in {path}")
        meta = {"format": "pt", "writer": FORMAT, "save_id": save_id}
        header = _header_bytes([(k, c, s, n) for _, k, c, s, n in layout], meta)
        results, at = [], 8 + len(header)
        for it, key, code, shape, length in layout:
            encoding = blobs[id(it)][1] if it.type == WriteItemType.BYTE_IO else "tensor"
            results.append(WriteResult(index=it.index, size_in_bytes=length,
                                       storage_data=StoredItem(name, key, at, length, encoding)))
            at += length
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as e:
            raise IoError(f"rank {self.rank}: cannot create {path}: {e.strerror or e}") from e
        try:
            _write_all(fd, len(header).to_bytes(8, "little") + header, 0, path, "the header")

            def write(indices: List[int]) -> None:
                for i in indices:
                    fault_point("save-write", self.rank)  # tests only: this rank dies between two writes
                    it, key, _, shape, _ = layout[i]
                    if it.type == WriteItemType.BYTE_IO:
                        _write_all(fd, blobs[id(it)][0], results[i].storage_data.offset, path, f"byte item '{key}'")
                    else:
                        self._write_tensor(fd, it, planner, path, key, shape, results[i].storage_data.offset)

            groups = _bins([n for _, _, _, _, n in layout], self.thread_count)
            if len(groups) <= 1:
                for g in groups:
                    write(g)
            else:
                from concurrent.futures import ThreadPoolExecutor
                with ThreadPoolExecutor(len(groups)) as pool:
                    for f in [pool.submit(write, g) for g in groups]:
                        f.result()  # the first failure, once every thread has stopped
            if self.sync_files:
                os.fsync(fd)
        finally:
            os.close(fd)
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def _write_tensor(self, fd: int, it: WriteItem, planner: SavePlanner, path: str, key: str,
                      shape: List[int], at: int) -> None:
        t = planner.resolve_data(it)
        want = it.tensor_data.properties.dtype
        if not isinstance(t, torch.Tensor) or list(t.shape) != shape or t.dtype != want:
            got = f"{list(t.shape)} of {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise InternalError(f"rank {self.rank}: '{key}': the planner resolved {got}, its plan says {shape} of {want}")
        _write_tensor(fd, t, at, self.block_bytes, path, key)

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for rank_results in results for wr in rank_results}
        metadata.storage_meta = StorageMeta(checkpoint_id=self.path, save_id=self._written_save_id or self.save_id)
        text = encode_metadata(metadata)
        final = self._metadata_path()
        tmp = f"{final}.tmp-{self.save_id}"
        try:
            with open(tmp, "wb") as f:
                f.write(text)
                if self.sync_files:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, final)
            if self.sync_files:
                _fsync_dir(self.path)
        except OSError as e:
            raise IoError(f"rank {self.rank}: cannot write the metadata {final}: {e.strerror or e}") from e
        self._remove_stale({s.file for s in metadata.storage_data.values()})

    def _remove_stale(self, named: set) -> None:
        """Rank files of an earlier save in `path` that the new metadata does not name: shardcast's, and
        torch's "__<rank>_<n>.distcp" of a checkpoint this save replaced."""
        for entry in os.listdir(self.path):
            if (_FILE_RE.match(entry) or _TORCH_FILE_RE.match(entry)) and entry not in named:
                try:
                    os.unlink(os.path.join(self.path, entry))
                except OSError:
                    pass  # a leftover is harmless: no metadata names it

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike)) and "://" not in os.fspath(checkpoint_id)
