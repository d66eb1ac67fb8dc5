"""The training state's JSON (shardcast.dcp._state): the tables its files share, a byte item's plain value
as tagged JSON, and DCP's Metadata as JSON (`.metadata.json`). Everything decoded here is hostile input:
every error is a CheckpointError naming where it was found."""
from __future__ import annotations

import base64
import collections
import dataclasses
import io
import json
import math
import os
import re
import sys
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

def _numpy_globals() -> list:
    """What torch.save writes for numpy arrays and scalars (an RNG state, a data loader's position), allowed
    to the weights-only unpickler as torch's documentation allows them: they build arrays and scalars, and
    anything an object array would hold still has to be allowed on its own."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover -- torch's .numpy() needs it anyway
        return []
    core = getattr(np, "_core", None) or np.core
    dtypes = [type(np.dtype(c)) for c in "?bhilqBHILQefdgFDG"]
    return [core.multiarray._reconstruct, core.multiarray.scalar, np.ndarray, np.dtype, *dtypes]


def _weights_only_load(data: bytes) -> Any:
    with torch.serialization.safe_globals([io.BytesIO, *_numpy_globals()]):
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


_NUMPY_DTYPE = re.compile(r"[<>|=][biufc][0-9]{1,2}")  # numpy's dtype.str of a number or bool: "<f8", "|b1"


def _numpy_value(v: Any, where: str) -> Any:
    """A numpy array or scalar of numbers or bools as JSON-ready data; None for any other value."""
    np = sys.modules.get("numpy")
    if np is None or not isinstance(v, (np.ndarray, np.generic)) or not _NUMPY_DTYPE.fullmatch(v.dtype.str):
        return None
    data = base64.b64encode(np.ascontiguousarray(v).tobytes()).decode("ascii")
    if isinstance(v, np.generic):
        return {"npscalar": {"dtype": v.dtype.str, "data": data}}
    return {"ndarray": {"dtype": v.dtype.str, "shape": list(v.shape), "data": data}}


def _decode_numpy(tag: str, spec: Any, where: str) -> Any:
    import numpy as np
    keys = {"dtype", "data"} | ({"shape"} if tag == "ndarray" else set())
    if not isinstance(spec, dict) or set(spec) != keys or not isinstance(spec["dtype"], str) or \
            not _NUMPY_DTYPE.fullmatch(spec["dtype"]):
        raise CheckpointError(f"{where}: malformed numpy value")
    dtype = np.dtype(spec["dtype"])
    shape = _dims(spec["shape"], where, "shape") if tag == "ndarray" else []
    data = base64.b64decode(spec["data"], validate=True)
    if len(data) != math.prod(shape) * dtype.itemsize:
        raise CheckpointError(f"{where}: numpy value of shape {shape} and dtype {spec['dtype']} holds {len(data)} bytes")
    array = np.frombuffer(data, dtype=dtype).reshape(shape).copy()
    return array if tag == "ndarray" else array[()]


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
    numpy_value = _numpy_value(v, where)
    if numpy_value is not None:
        return numpy_value
    raise Unsupported(f"{where}: a value of type {type(v).__module__}.{type(v).__qualname__} is not plain data "
                      f"(None, bool, int, float, str, bytes, list, tuple, dict, torch.Size/dtype/device, a CPU "
                      f"tensor, a numpy array or scalar of numbers) and cannot be stored as JSON; convert it, or pass allow_pickle=True to the writer "
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
        if tag in ("ndarray", "npscalar"):
            return _decode_numpy(tag, body, where)
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
            key = f"{fqn}@{','.join(map(str, offsets))}"
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
