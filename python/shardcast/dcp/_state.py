"""StorageWriter and StorageReader: a whole training state (model, optimizer, scheduler, DCP's byte items)
behind torch.distributed.checkpoint, stored as safetensors plus JSON. Nothing on disk is a pickle.

    import torch.distributed.checkpoint as dcp
    from shardcast.dcp import StorageReader, StorageWriter

    dcp.save(state, storage_writer=StorageWriter(path))
    dcp.load(state, storage_reader=StorageReader(path))

They stand where torch's FileSystemWriter / FileSystemReader stand; DCP's planner still flattens, dedups
and reshards. The directory:

    path/
      __0_0.safetensors     rank 0's chunks, each a contiguous tensor "<fqn>@<offsets>" (a DTensor's local
      __1_0.safetensors     shard, an optimizer moment's shard, a scalar step), and its byte items, each a
      ...                   uint8 tensor "<fqn>" holding the value as tagged JSON (below)
      .metadata.json        DCP's Metadata as JSON, written last by the coordinator (tmp + fsync + rename):
                            a directory without it is not a checkpoint, so a killed save never looks done

  one rank file:  [u64 n][header: n bytes of JSON, space-padded][tensor 0 bytes][tensor 1 bytes]...
                         {"<fqn>@0,0": {"dtype": "F32", "shape": [8, 32], "data_offsets": [0, 1024]}, ...}

Byte items. DCP hands a writer every non-tensor value (an lr, betas, a scheduler's last_epoch, a
dataloader's state) as torch.save bytes: a pickle. The writer decodes them with torch's weights-only
unpickler (plain data only, no code runs) and stores the value as tagged JSON; the reader rebuilds it and
hands DCP's planner fresh torch.save bytes of it. A value that is not plain data (an object of the user's
own class) is refused with Unsupported, unless `allow_pickle=True` is given to the writer (the bytes are
then stored as they are, marked "torch.save") and to the reader (which otherwise refuses to unpickle them).

Failures raise a shardcast exception (CheckpointError for a bad checkpoint, IoError for a failed write,
Unsupported for a value JSON cannot hold) naming the file, key and rank. DCP gathers every rank's exception
in its plan, write and read steps and raises its CheckpointException on every rank; these classes run no
collective of their own, so nothing here can leave a rank waiting.
"""
from __future__ import annotations

import base64
import collections
import dataclasses
import io
import json
import math
import os
import re
import uuid
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan,
                                                  SavePlanner, WriteItem, WriteItemType)
from torch.distributed.checkpoint.storage import StorageReader as _TorchStorageReader
from torch.distributed.checkpoint.storage import StorageWriter as _TorchStorageWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .._shardcast import CheckpointError, InternalError, InvalidArgument, IoError, Unsupported, fault_point

METADATA_NAME = ".metadata.json"
FORMAT = "shardcast-dcp-state"
FORMAT_VERSION = 1
DEFAULT_BLOCK_BYTES = 64 << 20            # one write, or one copy between madvise calls
DEFAULT_MAX_HEADER_BYTES = 100_000_000   # the safetensors crate's cap
DEFAULT_MAX_METADATA_BYTES = 4 << 30
_FILE_RE = re.compile(r"^__[0-9]{1,9}_[0-9]{1,9}\.safetensors$")
_MAX_DIM = 1 << 62

# dtype by name: the names DCP's metadata uses (torch's own), and the safetensors codes of the rank files.
_DTYPES: Dict[str, Tuple[torch.dtype, str]] = {}
for _name, _code in (("float64", "F64"), ("float32", "F32"), ("float16", "F16"), ("bfloat16", "BF16"),
                     ("int64", "I64"), ("int32", "I32"), ("int16", "I16"), ("int8", "I8"), ("uint8", "U8"),
                     ("bool", "BOOL"), ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
                     ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"), ("float8_e8m0fnu", "F8_E8M0"),
                     ("complex64", "C64")):
    if hasattr(torch, _name):
        _DTYPES[_name] = (getattr(torch, _name), _code)
_NAME_OF = {dt: name for name, (dt, _) in _DTYPES.items()}
_BY_CODE = {code: dt for dt, code in _DTYPES.values()}
_CODE_OF = {dt: code for dt, code in _DTYPES.values()}
_MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format, "channels_last": torch.channels_last,
                   "preserve_format": torch.preserve_format}
_LAYOUTS = {"strided": torch.strided, "sparse_coo": torch.sparse_coo}


@dataclasses.dataclass(frozen=True)
class StoredItem:
    """Where one item lives (the storage_data DCP keeps per MetadataIndex): `key` in rank file `file`, its
    bytes at [offset, offset + length) of the file. encoding: "tensor" (raw little-endian elements),
    "json" (a byte item's value as tagged JSON) or "torch.save" (a byte item kept pickled, by opt-in)."""
    file: str
    key: str
    offset: int
    length: int
    encoding: str = "tensor"


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------------------
# Byte items: plain Python values as tagged JSON. A JSON object is always a tag, so a value reads back as
# exactly the type it was written as (a tuple stays a tuple, an int key stays an int, 1.0 stays a float).

def _weights_only_load(data: bytes) -> Any:
    with torch.serialization.safe_globals([io.BytesIO]):
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def encode_value(v: Any, where: str) -> Any:
    """v as JSON-ready data; Unsupported (naming `where`) for anything that is not plain data."""
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"float": repr(v)}
    if isinstance(v, list):
        return [encode_value(x, where) for x in v]
    if isinstance(v, tuple) and type(v) is tuple:
        return {"tuple": [encode_value(x, where) for x in v]}
    if isinstance(v, torch.Size):
        return {"size": list(v)}
    if type(v) in (dict, collections.OrderedDict):
        tag = "dict" if type(v) is dict else "odict"
        return {tag: [[encode_value(k, where), encode_value(x, where)] for k, x in v.items()]}
    if isinstance(v, (bytes, bytearray)):
        return {"bytes": base64.b64encode(bytes(v)).decode("ascii")}
    if isinstance(v, io.BytesIO):
        return {"bytesio": base64.b64encode(v.getvalue()).decode("ascii"), "pos": v.tell()}
    if isinstance(v, torch.dtype) and v in _NAME_OF:
        return {"dtype": _NAME_OF[v]}
    if isinstance(v, torch.device):
        return {"device": str(v)}
    if isinstance(v, torch.Tensor) and type(v) is torch.Tensor and v.dtype in _NAME_OF and v.layout == torch.strided:
        return {"tensor": {"dtype": _NAME_OF[v.dtype], "shape": list(v.shape), "requires_grad": v.requires_grad,
                           "data": base64.b64encode(_tensor_bytes(v)).decode("ascii")}}
    raise Unsupported(f"{where}: a value of type {type(v).__module__}.{type(v).__qualname__} is not plain data "
                      f"(None, bool, int, float, str, bytes, list, tuple, dict, torch.Size/dtype/device, a CPU "
                      f"tensor) and cannot be stored as JSON; convert it, or pass allow_pickle=True to the writer "
                      f"and reader to keep it as torch.save bytes")


def _decode_tensor(spec: Any, where: str) -> torch.Tensor:
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "requires_grad", "data"}:
        raise CheckpointError(f"{where}: malformed tensor value")
    dtype = _dtype_by_name(spec["dtype"], where)
    shape = _dims(spec["shape"], where, "shape")
    data = base64.b64decode(spec["data"], validate=True)
    if len(data) != math.prod(shape) * dtype.itemsize:
        raise CheckpointError(f"{where}: tensor value of shape {shape} and dtype {spec['dtype']} holds "
                              f"{len(data)} bytes")
    t = torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape) if data else torch.empty(shape, dtype=dtype)
    return t.requires_grad_(bool(spec["requires_grad"])) if t.is_floating_point() else t


def decode_value(v: Any, where: str) -> Any:
    """The inverse of encode_value, on hostile input: CheckpointError for anything it did not write."""
    if v is None or isinstance(v, (bool, str, int, float)):
        return v
    if isinstance(v, list):
        return [decode_value(x, where) for x in v]
    if not isinstance(v, dict) or len(v) not in (1, 2):
        raise CheckpointError(f"{where}: malformed value {str(v)[:80]}")
    tag = next(iter(v))
    body = v[tag]
    try:
        if tag == "float" and body in ("nan", "inf", "-inf"):
            return float(body)
        if tag == "tuple" and isinstance(body, list):
            return tuple(decode_value(x, where) for x in body)
        if tag == "size":
            return torch.Size(_dims(body, where, "size"))
        if tag in ("dict", "odict") and isinstance(body, list):
            pairs = []
            for pair in body:
                if not isinstance(pair, list) or len(pair) != 2:
                    raise CheckpointError(f"{where}: malformed dict entry")
                pairs.append((decode_value(pair[0], where), decode_value(pair[1], where)))
            return dict(pairs) if tag == "dict" else collections.OrderedDict(pairs)
        if tag == "bytes" and isinstance(body, str):
            return base64.b64decode(body, validate=True)
        if tag == "bytesio" and isinstance(body, str) and isinstance(v.get("pos"), int):
            out = io.BytesIO(base64.b64decode(body, validate=True))
            out.seek(v["pos"])
            return out
        if tag == "dtype":
            return _dtype_by_name(body, where)
        if tag == "device" and isinstance(body, str):
            return torch.device(body)
        if tag == "tensor":
            return _decode_tensor(body, where)
    except CheckpointError:
        raise
    except (TypeError, ValueError, RuntimeError) as e:  # a bad base64, a bad device string, an unhashable key
        raise CheckpointError(f"{where}: malformed '{tag}' value ({type(e).__name__}: {e})") from e
    raise CheckpointError(f"{where}: unknown value tag '{tag}'")


# ---------------------------------------------------------------------------------------------------------
# Metadata <-> JSON. Every field DCP's planners read round-trips; decoding treats the file as hostile.

def _dtype_by_name(name: Any, where: str) -> torch.dtype:
    if not isinstance(name, str) or name not in _DTYPES:
        raise CheckpointError(f"{where}: unknown dtype {name!r} (known: {', '.join(sorted(_DTYPES))})")
    return _DTYPES[name][0]


def _dims(v: Any, where: str, what: str) -> List[int]:
    if not isinstance(v, list) or not all(type(x) is int and 0 <= x < _MAX_DIM for x in v):
        raise CheckpointError(f"{where}: {what} must be a list of non-negative integers, not {str(v)[:80]}")
    return v


def _name_of(dtype: torch.dtype, where: str) -> str:
    if dtype not in _NAME_OF:
        raise Unsupported(f"{where}: dtype {dtype} has no safetensors equivalent")
    return _NAME_OF[dtype]


def _encode_properties(p: TensorProperties, where: str) -> dict:
    layout = {v: k for k, v in _LAYOUTS.items()}.get(p.layout)
    memory_format = {v: k for k, v in _MEMORY_FORMATS.items()}.get(p.memory_format)
    if layout is None or memory_format is None:
        raise Unsupported(f"{where}: layout {p.layout} / memory format {p.memory_format} cannot be stored")
    return {"dtype": _name_of(p.dtype, where), "layout": layout, "requires_grad": bool(p.requires_grad),
            "memory_format": memory_format, "pin_memory": bool(p.pin_memory),
            "strides": None if p.strides is None else list(p.strides)}


def _decode_properties(d: Any, where: str) -> TensorProperties:
    if not isinstance(d, dict) or d.get("layout") not in _LAYOUTS or d.get("memory_format") not in _MEMORY_FORMATS:
        raise CheckpointError(f"{where}: malformed tensor properties")
    strides = d.get("strides")
    if strides is not None and not (isinstance(strides, list) and all(type(s) is int for s in strides)):
        raise CheckpointError(f"{where}: malformed strides {str(strides)[:80]}")
    return TensorProperties(dtype=_dtype_by_name(d.get("dtype"), where), layout=_LAYOUTS[d["layout"]],
                            requires_grad=bool(d.get("requires_grad")),
                            memory_format=_MEMORY_FORMATS[d["memory_format"]], pin_memory=bool(d.get("pin_memory")),
                            strides=None if strides is None else tuple(strides))


def _encode_entry(fqn: str, md: Any) -> dict:
    if isinstance(md, BytesStorageMetadata):
        return {"type": "bytes"}
    if not isinstance(md, TensorStorageMetadata):
        raise Unsupported(f"'{fqn}': storage metadata of type {type(md).__name__} cannot be stored")
    return {"type": "tensor", "properties": _encode_properties(md.properties, f"'{fqn}'"), "size": list(md.size),
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks]}


def _decode_entry(fqn: str, d: Any, where: str) -> Any:
    w = f"{where}: '{fqn}'"
    if isinstance(d, dict) and d.get("type") == "bytes":
        return BytesStorageMetadata()
    if not isinstance(d, dict) or d.get("type") != "tensor" or not isinstance(d.get("chunks"), list):
        raise CheckpointError(f"{w}: malformed entry")
    size = _dims(d.get("size"), w, "size")
    chunks = []
    for c in d["chunks"]:
        if not isinstance(c, dict):
            raise CheckpointError(f"{w}: malformed chunk")
        offsets, sizes = _dims(c.get("offsets"), w, "chunk offsets"), _dims(c.get("sizes"), w, "chunk sizes")
        if len(offsets) != len(size) or len(sizes) != len(size) or any(
                o + s > n for o, s, n in zip(offsets, sizes, size)):
            raise CheckpointError(f"{w}: chunk at {offsets} of sizes {sizes} lies outside the tensor's size {size}")
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
    return TensorStorageMetadata(properties=_decode_properties(d.get("properties"), w), size=torch.Size(size),
                                 chunks=chunks)


def _encode_planner_data(pd: Any) -> Any:
    if pd is None:
        return None
    if isinstance(pd, dict) and all(isinstance(k, str) and isinstance(p, tuple) and all(
            type(x) in (str, int) for x in p) for k, p in pd.items()):
        return {k: list(p) for k, p in pd.items()}
    raise Unsupported(f"planner_data of type {type(pd).__name__} is not the default planner's flatten mapping "
                      "({fqn: tuple of str/int}) and cannot be stored as JSON")


def _decode_planner_data(d: Any, where: str) -> Any:
    if d is None:
        return None
    if not isinstance(d, dict) or not all(isinstance(p, list) and p and all(type(x) in (str, int) for x in p)
                                          for p in d.values()):
        raise CheckpointError(f"{where}: malformed planner_data (want {{fqn: [str or int, ...]}})")
    return {k: tuple(p) for k, p in d.items()}


def _encode_storage_meta(sm: Optional[StorageMeta]) -> Any:
    if sm is None:
        return None
    return {"checkpoint_id": None if sm.checkpoint_id is None else os.fspath(sm.checkpoint_id),
            "save_id": sm.save_id, "load_id": sm.load_id, "modules": list(sm.modules)}


def _decode_storage_meta(d: Any, where: str) -> StorageMeta:
    if d is None:
        return StorageMeta()
    ok = isinstance(d, dict) and all(d.get(k) is None or isinstance(d.get(k), str)
                                     for k in ("checkpoint_id", "save_id", "load_id"))
    if not ok or not isinstance(d.get("modules", []), list) or not all(isinstance(m, str) for m in d.get("modules", [])):
        raise CheckpointError(f"{where}: malformed storage_meta")
    return StorageMeta(checkpoint_id=d.get("checkpoint_id"), save_id=d.get("save_id"), load_id=d.get("load_id"),
                       modules=list(d.get("modules", [])))


def encode_metadata(md: Metadata) -> bytes:
    """DCP's Metadata (storage_data: {MetadataIndex: StoredItem}) as JSON bytes."""
    storage = []
    for index, item in md.storage_data.items():
        if not isinstance(item, StoredItem):
            raise InternalError(f"'{index.fqn}': storage data {type(item).__name__} is not shardcast's")
        storage.append({"fqn": index.fqn, "offset": None if index.offset is None else list(index.offset),
                        "index": index.index, "file": item.file, "key": item.key, "byte_offset": item.offset,
                        "length": item.length, "encoding": item.encoding})
    doc = {"format": FORMAT, "format_version": FORMAT_VERSION, "version": md.version,
           "state_dict_metadata": {fqn: _encode_entry(fqn, e) for fqn, e in md.state_dict_metadata.items()},
           "storage_data": storage, "planner_data": _encode_planner_data(md.planner_data),
           "storage_meta": _encode_storage_meta(md.storage_meta)}
    return json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()


def _decode_storage(rows: Any, sdm: Dict[str, Any], where: str) -> Dict[MetadataIndex, StoredItem]:
    """storage_data, checked against state_dict_metadata: every chunk and byte item has exactly one place,
    of the chunk's byte length, in a rank file named as the writer names them."""
    if not isinstance(rows, list):
        raise CheckpointError(f"{where}: storage_data must be a list")
    chunk_bytes = {}  # (fqn, offsets) -> bytes of the chunk
    for fqn, e in sdm.items():
        if isinstance(e, TensorStorageMetadata):
            for c in e.chunks:
                chunk_bytes[(fqn, tuple(c.offsets))] = math.prod(c.sizes) * e.properties.dtype.itemsize
    out: Dict[MetadataIndex, StoredItem] = {}
    for r in rows:
        if not isinstance(r, dict) or not isinstance(r.get("fqn"), str) or r["fqn"] not in sdm:
            raise CheckpointError(f"{where}: storage entry {str(r)[:120]} names no item of state_dict_metadata")
        fqn, w = r["fqn"], f"{where}: '{r['fqn']}'"
        if not isinstance(r.get("file"), str) or not _FILE_RE.match(r["file"]) or not isinstance(r.get("key"), str):
            raise CheckpointError(f"{w}: file {str(r.get('file'))[:80]!r} is not a rank file name (__<rank>_<n>.safetensors)")
        if type(r.get("byte_offset")) is not int or type(r.get("length")) is not int or r["byte_offset"] < 0 or r["length"] < 0:
            raise CheckpointError(f"{w}: malformed byte range")
        hint = r.get("index")
        if hint is not None and type(hint) is not int:
            raise CheckpointError(f"{w}: malformed index hint")
        if isinstance(sdm[fqn], BytesStorageMetadata):
            if r.get("offset") is not None or r.get("encoding") not in ("json", "torch.save"):
                raise CheckpointError(f"{w}: a byte item stored as {r.get('encoding')!r} at offset {r.get('offset')}")
            index = MetadataIndex(fqn, None, hint)
        else:
            offsets = tuple(_dims(r.get("offset"), w, "offset"))
            want = chunk_bytes.get((fqn, offsets))
            if want is None or r.get("encoding") != "tensor" or r["length"] != want:
                raise CheckpointError(f"{w}: stored chunk at {list(offsets)} ({r['length']} bytes, "
                                      f"{r.get('encoding')!r}) matches no chunk of its metadata")
            index = MetadataIndex(fqn, offsets, hint)
        if index in out:
            raise CheckpointError(f"{w}: stored twice at offset {r.get('offset')}")
        out[index] = StoredItem(r["file"], r["key"], r["byte_offset"], r["length"], r["encoding"])
    missing = [k for k, e in sdm.items() if isinstance(e, BytesStorageMetadata) and MetadataIndex(k) not in out]
    missing += [f"{f}@{list(o)}" for f, o in chunk_bytes if MetadataIndex(f, o) not in out]
    if missing:
        raise CheckpointError(f"{where}: {len(missing)} item(s) have no place in any rank file, first: {missing[0]}")
    return out


def decode_metadata(text: bytes, where: str) -> Metadata:
    """Metadata from JSON bytes written by encode_metadata; CheckpointError naming `where` otherwise."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{where}: not JSON ({type(e).__name__}: {e})") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(f"{where}: not a shardcast training-state checkpoint (format {FORMAT!r} expected)")
    if doc.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{where}: format_version {doc.get('format_version')!r}; this shardcast reads "
                              f"{FORMAT_VERSION}")
    sdm_doc = doc.get("state_dict_metadata")
    if not isinstance(sdm_doc, dict):
        raise CheckpointError(f"{where}: state_dict_metadata must be an object")
    sdm = {fqn: _decode_entry(fqn, e, where) for fqn, e in sdm_doc.items()}
    version = doc.get("version")
    if version is not None and not isinstance(version, str):
        raise CheckpointError(f"{where}: malformed version")
    return Metadata(state_dict_metadata=sdm, planner_data=_decode_planner_data(doc.get("planner_data"), where),
                    storage_data=_decode_storage(doc.get("storage_data"), sdm, where),
                    storage_meta=_decode_storage_meta(doc.get("storage_meta"), where), version=version)


# ---------------------------------------------------------------------------------------------------------
# Rank files: the safetensors layout, written streamed and read through one mapping.

def _header_bytes(entries: List[Tuple[str, str, List[int], int]], meta: Dict[str, str]) -> bytes:
    """The header of a file holding entries [(key, code, shape, length)] back to back, in order."""
    header: Dict[str, Any] = {"__metadata__": meta}
    at = 0
    for key, code, shape, length in entries:
        header[key] = {"dtype": code, "shape": shape, "data_offsets": [at, at + length]}
        at += length
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)


def _write_all(fd: int, buf, at: int, path: str, what: str) -> None:
    """buf's bytes at file offset `at` (pwrite: threads write their own items side by side)."""
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        try:
            done += os.pwrite(fd, view[done:done + DEFAULT_BLOCK_BYTES], at + done)
        except OSError as e:
            raise IoError(f"rank {_rank()}: cannot write {what} to {path}: {e.strerror or e}") from e


def _write_tensor(fd: int, t: torch.Tensor, at: int, block_bytes: int, path: str, key: str) -> None:
    """t's elements, row-major, at file offset `at`, in pieces of at most block_bytes (a device tensor is
    staged piece by piece)."""
    t = t.detach()
    if t.numel() == 0:
        return
    flat = t.contiguous().reshape(-1).view(torch.uint8)
    for start in range(0, flat.numel(), block_bytes):
        piece = flat[start:start + block_bytes]
        if piece.device.type != "cpu":
            piece = piece.cpu()
        _write_all(fd, piece.numpy(), at + start, path, f"tensor '{key}'")


def _bins(sizes: List[int], n: int) -> List[List[int]]:
    """Indices of `sizes` in n bins of about equal sums, largest first (each bin one writer thread)."""
    bins: List[List[int]] = [[] for _ in range(n)]
    sums = [0] * n
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        j = sums.index(min(sums))
        bins[j].append(i)
        sums[j] += sizes[i]
    return [sorted(b) for b in bins if b]


class _RankFile:
    """One rank file opened for reading: its header validated, its bytes read with pread (not mapped: a
    file that shrinks after its header was validated is then a CheckpointError naming it, where a mapping
    would kill the process with SIGBUS). The header is hostile: capped, every entry's dtype known, its
    byte range of exactly numel * itemsize bytes, and the entries tiling the data area with no gap,
    overlap or tail."""

    def __init__(self, path: str, max_header_bytes: int) -> None:
        self.path, self.rank = path, _rank()
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise CheckpointError(f"rank {self.rank}: cannot open rank file {path}: {e.strerror or e}") from e
        self.fd = fd
        try:
            size = os.fstat(fd).st_size
            head = os.pread(fd, 8, 0)
            if len(head) < 8:
                raise CheckpointError(f"rank {self.rank}: {path} is {size} bytes, shorter than a safetensors header")
            n = int.from_bytes(head, "little")
            if n > max_header_bytes or 8 + n > size:
                raise CheckpointError(f"rank {self.rank}: {path}: header of {n} bytes exceeds the cap of "
                                      f"{max_header_bytes} or the file's {size} bytes (truncated?)")
            self.entries = self._parse(os.pread(fd, n, 8), size - 8 - n)
            self.data_start, self.size = 8 + n, size
        except BaseException:
            self.close()
            raise

    def _parse(self, text: bytes, data_bytes: int) -> Dict[str, Tuple[torch.dtype, List[int], int, int]]:
        where = f"rank {self.rank}: {self.path}"
        try:
            header = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise CheckpointError(f"{where}: header is not JSON ({e})") from e
        if not isinstance(header, dict):
            raise CheckpointError(f"{where}: header is not a JSON object")
        header.pop("__metadata__", None)
        entries, spans = {}, []
        for key, e in header.items():
            if not isinstance(e, dict) or e.get("dtype") not in _BY_CODE or not isinstance(e.get("data_offsets"), list):
                raise CheckpointError(f"{where}: tensor '{key}': malformed entry or unknown dtype {str(e)[:80]}")
            dtype = _BY_CODE[e["dtype"]]
            shape = _dims(e.get("shape"), f"{where}: tensor '{key}'", "shape")
            begin, end = (_dims(e["data_offsets"], f"{where}: tensor '{key}'", "data_offsets") + [None, None])[:2]
            if len(e["data_offsets"]) != 2 or end < begin or end - begin != math.prod(shape) * dtype.itemsize:
                raise CheckpointError(f"{where}: tensor '{key}': data_offsets {e['data_offsets']} do not hold "
                                      f"{shape} of {e['dtype']}")
            entries[key] = (dtype, shape, begin, end)
            spans.append((begin, end, key))
        at = 0
        for begin, end, key in sorted(spans):
            if begin != at:
                raise CheckpointError(f"{where}: tensor '{key}' starts at data byte {begin}, expected {at} "
                                      f"(a gap or an overlap)")
            at = end
        if at != data_bytes:
            raise CheckpointError(f"{where}: the header's tensors end at data byte {at} but the file holds "
                                  f"{data_bytes} data bytes ({'truncated' if at > data_bytes else 'trailing bytes'})")
        return entries

    def locate(self, key: str, item: StoredItem, dtype: Optional[torch.dtype], shape: Optional[List[int]]) -> int:
        """The file offset of `key`'s bytes, after checking they are where and what the metadata says."""
        e = self.entries.get(key)
        where = f"rank {self.rank}: {self.path}: tensor '{key}'"
        if e is None:
            raise CheckpointError(f"{where}: not in the file's header")
        e_dtype, e_shape, begin, end = e
        if self.data_start + begin != item.offset or end - begin != item.length:
            raise CheckpointError(f"{where}: at file bytes [{self.data_start + begin}, {self.data_start + end}), "
                                  f"the metadata says [{item.offset}, {item.offset + item.length})")
        if dtype is not None and (e_dtype != dtype or e_shape != shape):
            raise CheckpointError(f"{where}: the file holds {list(e_shape)} of {e_dtype}, the metadata says "
                                  f"{shape} of {dtype}")
        return item.offset

    def read_into(self, offset: int, out: torch.Tensor, what: str) -> None:
        """File bytes [offset, offset + out's bytes) into `out` (contiguous, on CPU)."""
        if out.numel() == 0:
            return
        self._read(offset, memoryview(out.reshape(-1).view(torch.uint8).numpy()), what)

    def read_bytes(self, offset: int, length: int, what: str) -> bytes:
        buf = bytearray(length)
        self._read(offset, memoryview(buf), what)
        return bytes(buf)

    def _read(self, offset: int, into: memoryview, what: str) -> None:
        done = 0
        while done < len(into):
            try:
                n = os.preadv(self.fd, [into[done:]], offset + done)
            except OSError as e:
                raise IoError(f"rank {self.rank}: {self.path}: {what}: cannot read: {e.strerror or e}") from e
            if n == 0:
                raise CheckpointError(f"rank {self.rank}: {self.path}: {what}: the file ends at byte {offset + done}, "
                                      f"{len(into) - done} bytes short (it shrank after it was opened)")
            done += n

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _copy_box(f: _RankFile, base: int, dtype: torch.dtype, chunk: List[int], offsets: List[int],
              lengths: List[int], dest: torch.Tensor, block_bytes: int, what: str) -> None:
    """The box (offsets, lengths) of the stored chunk at file offset `base` into dest, row block by row
    block along dim 0: a block of whole rows is read straight into a CPU dest; otherwise it is staged
    (one buffer of at most block_bytes) and its window copied:

        stored chunk (rows of the file)      dest (the planner's tensor)
        +------------------+                 +---------+
        |     .-------.    |  block 0  --->  |         |
        |     | box   |    |  block 1  --->  |         |
        |     '-------'    |                 +---------+
        +------------------+
    """
    if math.prod(lengths) == 0:
        return
    if not chunk:  # a scalar
        stage = torch.empty([], dtype=dtype)
        f.read_into(base, stage, what)
        dest.copy_(stage)
        return
    row_bytes = math.prod(chunk[1:]) * dtype.itemsize
    rows = min(lengths[0], max(1, block_bytes // row_bytes))
    whole_rows = list(lengths[1:]) == list(chunk[1:]) and dest.device.type == "cpu"
    stage = None
    for r in range(0, lengths[0], rows):
        b = min(rows, lengths[0] - r)
        at = base + (offsets[0] + r) * row_bytes
        out = dest.narrow(0, r, b)
        if whole_rows and out.is_contiguous():
            f.read_into(at, out, what)
            continue
        if stage is None:
            stage = torch.empty(rows * row_bytes, dtype=torch.uint8)
        src = stage[:b * row_bytes].view(dtype).view([b] + list(chunk[1:]))
        f.read_into(at, src, what)
        for d in range(1, len(chunk)):
            src = src.narrow(d, offsets[d], lengths[d])
        out.copy_(src)


# ---------------------------------------------------------------------------------------------------------

class StorageWriter(_TorchStorageWriter):
    """`torch.distributed.checkpoint.FileSystemWriter`'s place, writing safetensors and JSON.

        dcp.save(state, storage_writer=shardcast.dcp.StorageWriter(path))

    `path`: the checkpoint directory (created). Keyword-only options, with their defaults:
    `overwrite` (True, as torch's: an existing checkpoint in `path` is replaced; its metadata is removed
    before any rank writes, so an interrupted overwrite leaves no checkpoint rather than a mixed one),
    `sync_files` (True: every rank file, the metadata and the directory are fsynced), `block_bytes` (64 MiB:
    the largest piece staged from a device or handed to one write), `thread_count` (1, as torch's: threads
    writing this rank's items into its one file side by side, each at its offset), `allow_pickle` (False:
    see the module's doc).

    Each rank writes one file, __<rank>_0.safetensors: its header first (every item's dtype, shape and
    offsets come from the plan), then each item at its offset (pwrite) as the planner resolves it, one at a
    time per thread. The
    coordinator writes .metadata.json in finish(), last and atomically, and removes rank files of an
    earlier save in `path` that the new metadata does not name.
    """

    def __init__(self, path: Union[str, os.PathLike], *, overwrite: bool = True, sync_files: bool = True,
                 block_bytes: int = DEFAULT_BLOCK_BYTES, thread_count: int = 1, allow_pickle: bool = False) -> None:
        super().__init__()
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

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank", _rank())
        self.use_collectives = kwargs.get("use_collectives", True)

    def _metadata_path(self) -> str:
        name = METADATA_NAME if self.use_collectives else f"__{self.rank}{METADATA_NAME}"
        return os.path.join(self.path, name)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as e:
            raise IoError(f"rank {self.rank}: cannot create {self.path}: {e.strerror or e}") from e
        if os.path.exists(self._metadata_path()) and not self.overwrite:
            raise CheckpointError(f"rank {self.rank}: {self.path} already holds a checkpoint and overwrite=False")
        if not self.use_collectives:  # every rank plans alone: it names its own file
            plan = dataclasses.replace(plan, storage_data=f"__{self.rank}_")
            self._forget_metadata()
        return plan

    def _forget_metadata(self) -> None:
        if os.path.exists(self._metadata_path()):
            os.unlink(self._metadata_path())
            if self.sync_files:
                _fsync_dir(self.path)

    def prepare_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
        # Before any rank writes (write_data follows this step), so an overwrite cut short looks unfinished.
        self._forget_metadata()
        return [dataclasses.replace(p, storage_data=f"__{i}_") if p.storage_data is None else p
                for i, p in enumerate(plans)]

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

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        name = f"{plan.storage_data}0.safetensors"
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
                key = f"{it.index.fqn}@{','.join(map(str, td.chunk.offsets))}"
                layout.append((it, key, _CODE_OF[td.properties.dtype], shape,
                               math.prod(shape) * td.properties.dtype.itemsize))
        if len({k for _, k, _, _, _ in layout}) != len(layout):
            raise InternalError(f"rank {self.rank}: two items of the plan have the same key in {path}")
        header = _header_bytes([(k, c, s, n) for _, k, c, s, n in layout], {"format": "pt", "writer": FORMAT})
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
        metadata.storage_meta = self.storage_meta()
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
        if self.use_collectives:
            self._remove_stale({s.file for s in metadata.storage_data.values()})

    def _remove_stale(self, named: set) -> None:
        for entry in os.listdir(self.path):
            if _FILE_RE.match(entry) and entry not in named:
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


class StorageReader(_TorchStorageReader):
    """`torch.distributed.checkpoint.FileSystemReader`'s place, reading what StorageWriter wrote.

        dcp.load(state, storage_reader=shardcast.dcp.StorageReader(path))

    Keyword-only options, with their defaults: `block_bytes` (64 MiB: the most file bytes a rank maps in
    before dropping them again, so RssFile stays bounded), `max_header_bytes` (100 MB: a rank file's
    header cap), `max_metadata_bytes` (4 GiB), `allow_pickle` (False: byte items the writer kept as
    torch.save bytes are refused, since unpickling them runs code from the checkpoint).

    read_metadata reads .metadata.json on every rank that calls it. A store exchange from rank 0 would
    save reads of one small file, but the reader is not told which group dcp.load runs over (a subgroup,
    no_dist, or one rank inspecting a checkpoint on its own), and a wait on a rank that is not loading is a
    hang until the timeout; a rank whose read fails raises in DCP's plan step, which reports it on every
    rank. The JSON is hostile input: sizes, chunk boxes, dtypes, file names (no path leaves the
    directory), and every chunk stored exactly once with its exact byte length.

    read_data maps each rank file it needs once, validates its header (capped, every entry inside the
    file, the entries tiling the data), checks each item against it (key, offsets, dtype, shape), and
    copies the requested box straight from the mapped bytes into planner.resolve_tensor(item), block by
    block, dropping each block's pages (madvise DONTNEED) once copied. A destination of another dtype is
    converted by copy_, as torch's reader converts.
    """

    def __init__(self, path: Union[str, os.PathLike], *, block_bytes: int = DEFAULT_BLOCK_BYTES,
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

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")  # DCP's fallback to rank-local metadata (a save without collectives)
        path = os.path.join(self.path, METADATA_NAME if rank is None else f"__{rank}{METADATA_NAME}")
        where = f"rank {_rank()}: {path}"
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > self.max_metadata_bytes:
                    raise CheckpointError(f"{where}: {size} bytes, over the cap of {self.max_metadata_bytes}")
                text = f.read()
        except OSError as e:
            raise CheckpointError(f"{where}: cannot read the checkpoint's metadata ({e.strerror or e}); "
                                  f"a directory without it is not a finished checkpoint") from e
        md = decode_metadata(text, where)
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.rank = kwargs.get("rank", _rank())
        if not isinstance(metadata.storage_data, dict) or not all(
                isinstance(v, StoredItem) for v in metadata.storage_data.values()):
            raise CheckpointError(f"rank {self.rank}: {self.path}: the metadata's storage_data is not shardcast's")
        self.storage_data = metadata.storage_data
        self._chunks = {(fqn, tuple(c.offsets)): (e.properties.dtype, list(c.sizes))
                        for fqn, e in metadata.state_dict_metadata.items() if isinstance(e, TensorStorageMetadata)
                        for c in e.chunks}

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        return plans

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

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        for name, reqs in self._by_file(plan).items():
            f = _RankFile(os.path.join(self.path, name), self.max_header_bytes)
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
        torch.save(decode_value(doc, where), out)
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
