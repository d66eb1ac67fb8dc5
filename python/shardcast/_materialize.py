"""Local storage for a model still on meta, zero-valued at no cost: what `load` gives a rank's shards.

    to_empty       malloc'ed storage: garbage (recycled heap), and bf16 garbage can be NaN
    zero_storage   host: shardcast's lazy-zero allocator (allocators/lazy_zero.h), a fresh anonymous
                   mapping per tensor of LAZY_ZERO_MIN_BYTES or more (heap zeros below) that reads as zeros
                   and commits each page only when first written, so materializing adds nothing to RssAnon
                   and the load's stream commits what it writes; CUDA: zeros (a device memset)

FSDP2 keeps each shard inside a flat buffer padded to ceil(n/W) rows, and after `Module._apply` it re-pads
a local tensor of another size into `new_zeros` (committed) and copies. Here the padded buffer itself is
allocated lazily and its first rows become the local tensor, so FSDP2 finds both in one storage and keeps
them (`reset_sharded_param`'s same-storage check, in torch 2.15; a torch without it re-pads, and then
only the ranks with fewer rows than the chunk commit their padded shard).

    padded storage (lazy zero)  [ row 0 | row 1 | ... | row k-1 | pad ... pad ]
    local tensor (the DTensor's)  <------- narrow(0, 0, k) ------>
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Sequence

import torch

from . import _shardcast


def zero_storage(model: torch.nn.Module, device: torch.device) -> None:
    """Replaces every parameter and buffer of `model` (DTensor or not, on meta or not) by zeros on `device`
    (CPU or CUDA), as `model.to_empty(device=device)` replaces them by empty tensors: the parameters keep
    their objects (FSDP2's and optimizers' references stay valid)."""
    padded = _fsdp_params(model)
    model._apply(lambda t: _zeros_like(t, device, padded.get(id(t))))


def adopt_storage(model: torch.nn.Module, given: Dict[int, Optional[torch.Tensor]],
                  device: torch.device = torch.device("cpu")) -> None:
    """Gives each FSDP2 parameter in `given` ({id(parameter): its padded storage, allocated and filled
    already: the stream beside the build}) that storage as its padded sharded buffer, its first rows as
    the local tensor, as zero_storage does with fresh zeros (a None storage: fresh zeros on `device`, for
    one loaded later); every other tensor stays as it is.
    REQUIRES: each storage has the parameter's padded shard shape (_padded_shape), on `device`."""
    padded = _fsdp_params(model)
    model._apply(lambda t: _zeros_like(t, device, padded.get(id(t)), given[id(t)]) if id(t) in given else t)


# Below this size a host tensor is heap zeros: a mapping of its own would cost a whole page once written (a
# norm's shard of a few hundred bytes), and a model has tens of thousands of such entries (DeepSeek-V3).
LAZY_ZERO_MIN_BYTES = 64 << 10


def zeros(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A contiguous zero tensor: lazy-zero on CPU (no page committed until written) from LAZY_ZERO_MIN_BYTES
    up, a memset below that and on CUDA."""
    shape = tuple(int(n) for n in shape)
    if device.type == "cpu" and math.prod(shape) * dtype.itemsize >= LAZY_ZERO_MIN_BYTES:
        try:
            return _shardcast.lazy_zero_tensor(list(shape), dtype)
        except _shardcast.IoError as e:  # a refused mapping: vm.max_map_count (65530 by default) reached
            _warn_once(e)
    return torch.zeros(shape, dtype=dtype, device=device)


_WARNED = []


def _warn_once(e: BaseException) -> None:
    """The first refused mapping is logged; the tensors from then on are heap zeros (committed), which
    is slower and larger but still correct."""
    if not _WARNED:
        _WARNED.append(e)
        import logging
        logging.getLogger("shardcast").warning(
            "lazy-zero mapping refused (%s); this rank's remaining shards are committed zeros. Raise "
            "vm.max_map_count if the model has tens of thousands of tensors per rank.", e)


def _zeros_like(t: torch.Tensor, device: torch.device, fsdp_param, storage=None) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    if not isinstance(t, DTensor):
        return zeros(t.shape, t.dtype, device)
    local_shape = tuple(t.to_local().shape)
    padded_shape = _padded_shape(fsdp_param, local_shape)
    if padded_shape is None:
        local = zeros(local_shape, t.dtype, device)
    else:
        storage = zeros(padded_shape, t.dtype, device) if storage is None else storage
        fsdp_param._sharded_param_data = storage.view(-1)  # FSDP2 sees its padded buffer: no second one
        local = storage.narrow(0, 0, local_shape[0])
    return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())


def _padded_shape(fsdp_param, local_shape: tuple) -> Optional[tuple]:
    """FSDP2's padded shard shape for this parameter, where it pads dim 0 of it; None otherwise (not an
    FSDP2 parameter, or a torch whose FSDPParam looks different: then the local tensor stands alone)."""
    if fsdp_param is None:
        return None
    placement = getattr(fsdp_param, "fsdp_placement", None)
    padded = getattr(fsdp_param, "padded_sharded_param_size", None)
    if getattr(placement, "dim", None) != 0 or padded is None or len(local_shape) == 0:
        return None
    padded = tuple(padded)
    if len(padded) != len(local_shape) or padded[1:] != local_shape[1:] or padded[0] < local_shape[0]:
        return None
    return padded


def cpu_offload(model: torch.nn.Module) -> Optional[bool]:
    """None where FSDP2 keeps `model`'s parameters on their mesh's device; where it offloads them to the
    host (CPUOffloadPolicy), whether it pins them."""
    for fsdp_param in _fsdp_params(model).values():
        if getattr(fsdp_param, "offload_to_cpu", False):
            return bool(getattr(fsdp_param, "pin_memory", True))
    return None


def _fsdp_params(model: torch.nn.Module) -> Dict[int, object]:
    """{id(sharded parameter): its FSDPParam} for every FSDP2 module in `model` (empty without FSDP2)."""
    out: Dict[int, object] = {}
    for module in model.modules():
        state_of = getattr(module, "_get_fsdp_state", None)
        if state_of is None:
            continue
        try:
            state = state_of()
        except Exception:  # noqa: BLE001 -- not an FSDP2 module after all: nothing padded to find
            continue
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # earlier torch: one group per module
            group = getattr(state, "_fsdp_param_group", None)
            groups = [group] if group is not None else []
        for group in groups:
            for fsdp_param in getattr(group, "fsdp_params", ()):
                out[id(fsdp_param.sharded_param)] = fsdp_param
    return out
