"""The training state's JSON (shardcast.dcp._state): the tables its files share and DCP's Metadata as JSON
(`.metadata.json`; a byte item's value: _state_values). Everything decoded here is hostile input: every
error is a CheckpointError naming where it was found."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)

from .._shardcast import CheckpointError, InternalError, Unsupported
from ._cover import cover_problem

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


def chunk_key(fqn: str, offsets) -> str:
    """A tensor chunk's key in its rank file (and its metadata row): "<fqn>@<offset>,<offset>,..."."""
    return f"{fqn}@{','.join(map(str, offsets))}"


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
            "strides": None if getattr(p, "strides", None) is None else list(p.strides)}


_HAS_STRIDES = "strides" in getattr(TensorProperties, "__dataclass_fields__", {})


def _decode_properties(d: Any, where: str) -> TensorProperties:
    if not isinstance(d, dict) or d.get("layout") not in _LAYOUTS or d.get("memory_format") not in _MEMORY_FORMATS:
        raise CheckpointError(f"{where}: malformed tensor properties")
    strides = d.get("strides")
    if strides is not None and not (isinstance(strides, list) and all(type(s) is int for s in strides)):
        raise CheckpointError(f"{where}: malformed strides {str(strides)[:80]}")
    # torch 2.15's TensorProperties has strides, 2.11's has none (an H200 found it): given where it has them
    more = {"strides": None if strides is None else tuple(strides)} if _HAS_STRIDES else {}
    return TensorProperties(dtype=_dtype_by_name(d.get("dtype"), where), layout=_LAYOUTS[d["layout"]],
                            requires_grad=bool(d.get("requires_grad")),
                            memory_format=_MEMORY_FORMATS[d["memory_format"]], pin_memory=bool(d.get("pin_memory")),
                            **more)


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
    why = cover_problem(size, [(c.offsets, c.sizes) for c in chunks])
    if why is not None:  # an element no chunk holds would be left as the destination had it
        raise CheckpointError(f"{w}: its chunks do not hold each element of size {size} exactly once: {why}")
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
            key = fqn
        else:
            offsets = tuple(_dims(r.get("offset"), w, "offset"))
            want = chunk_bytes.get((fqn, offsets))
            if want is None or r.get("encoding") != "tensor" or r["length"] != want:
                raise CheckpointError(f"{w}: stored chunk at {list(offsets)} ({r['length']} bytes, "
                                      f"{r.get('encoding')!r}) matches no chunk of its metadata")
            index = MetadataIndex(fqn, offsets, hint)
            key = chunk_key(fqn, offsets)
        if r["key"] != key:  # else a row could point at another chunk's bytes of the same size
            raise CheckpointError(f"{w}: stored under key {r['key'][:200]!r}, not its own {key!r}")
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
