"""What dcp_reader_worker.py's scenarios share: the checkpoint's keys, state dicts of sentinel DTensors in
layouts that cycle over the keys, bit-for-bit comparison of two state dicts (each rank's local pieces), and
the errors a failed dcp call gave."""
import os
import zlib

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor


def crc(t: torch.Tensor) -> int:
    t = t.detach().contiguous()
    return zlib.crc32(t.view(torch.uint8).numpy().tobytes()) if t.numel() else 0


def layouts(world):
    one = init_device_mesh("cpu", (world,))
    out = [(one, [Shard(0)]), (one, [Shard(1)]), (one, [Replicate()])]
    if world == 4:
        two = init_device_mesh("cpu", (2, 2))
        out += [(two, [Replicate(), Shard(0)]), (two, [Shard(0), Shard(1)]), (two, [Shard(1), Shard(0)])]
    return out


def sentinel_like(shape, dtype, mesh, placements):
    full = torch.full(shape, -7, dtype=dtype) if dtype.is_floating_point else torch.full(shape, 7, dtype=dtype)
    return distribute_tensor(full, mesh, placements)


def state_dict(keys, world, dtype_of=None, shift=0):
    """{key: DTensor of the key's shape filled with a sentinel}, the layouts cycling over the keys (from the
    shift-th layout on)."""
    ls = layouts(world)
    sd = {}
    for i, (key, (shape, dtype)) in enumerate(sorted(keys.items())):
        if dtype_of is not None:
            dtype = dtype_of(key, dtype)
        mesh, placements = ls[(i + shift) % len(ls)]
        if len(shape) < 2:
            placements = [p if not isinstance(p, Shard) else Shard(0) for p in placements]
        sd[key] = sentinel_like(shape, dtype, mesh, placements)
    return sd


def compare(a, b, what, problems):
    checked = 0
    for key in a:
        la = a[key].to_local() if isinstance(a[key], DTensor) else a[key]
        lb = b[key].to_local() if isinstance(b[key], DTensor) else b[key]
        if la.dtype != lb.dtype or la.shape != lb.shape or crc(la) != crc(lb):
            problems.append(f"{what}: {key} differs ({la.dtype} {tuple(la.shape)} vs {lb.dtype} {tuple(lb.shape)})")
        checked += 1
    return checked


def checkpoint_keys(path):
    from safetensors import safe_open
    keys = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), framework="pt") as f:
                for k in f.keys():
                    s = f.get_slice(k)
                    keys[k] = (tuple(s.get_shape()), _dtype(s.get_dtype()))
    return keys


def _dtype(name):
    return {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16, "F8_E4M3": torch.float8_e4m3fn,
            "U8": torch.uint8, "I64": torch.int64}[name]


def _read_all(path):
    from safetensors.torch import load_file
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


def errors_of(e: BaseException, rank: int) -> list:
    """["Class: message"] of every rank's failure DCP's CheckpointException carries (a BaseException, with
    `failures` by rank), or of `e` itself where it carries none."""
    failures = getattr(e, "failures", None) or {rank: (e, None)}
    return sorted({f"{type(x[0]).__name__}: {x[0]}" for x in failures.values()})
