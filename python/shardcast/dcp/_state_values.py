"""The training state's byte items (shardcast.dcp._state): plain Python values as tagged JSON. A JSON object is
always a tag, so a value reads back as exactly the type it was written as (a tuple stays a tuple, an int key
stays an int, 1.0 stays a float). Everything decoded here is hostile input: every error is a CheckpointError
naming where it was found."""
from __future__ import annotations

import base64
import collections
import io
import math
import re
import sys
from typing import Any

import torch

from .._shardcast import CheckpointError, Unsupported
from ._state_codec import _NAME_OF, _dims, _dtype_by_name

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
    # The exact types: a subclass (numpy.float64 of float, an IntEnum of int, a StrEnum of str) would come
    # back as its base; numpy's scalars go to their own encoding below, any other is not plain data.
    if v is None or type(v) in (bool, str, int):
        return v
    if type(v) is float:
        return v if math.isfinite(v) else {"float": repr(v)}
    if type(v) is list:
        return [encode_value(x, where) for x in v]
    if isinstance(v, tuple) and type(v) is tuple:
        return {"tuple": [encode_value(x, where) for x in v]}
    if isinstance(v, torch.Size):
        return {"size": list(v)}
    if type(v) in (dict, collections.OrderedDict):
        tag = "dict" if type(v) is dict else "odict"
        return {tag: [[encode_value(k, where), encode_value(x, where)] for k, x in v.items()]}
    if type(v) in (bytes, bytearray):
        return {"bytes": base64.b64encode(bytes(v)).decode("ascii")}
    if type(v) is io.BytesIO:
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
