"""shardcast for FSDP2 training scripts.

    with torch.device("meta"):
        model = build_model(config)
    shardcast.prepare(model, config=config)        # params stay meta; non-persistent buffers computed
    for block in model.model.layers:
        fully_shard(block)
    fully_shard(model)
    report = shardcast.load(model, checkpoint_dir)  # each rank receives only its own rows

Every rank calls `load` together. Errors are one exception class per kind of failure, all subclasses
of `ShardcastError`, with the same message on every rank.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Dict, Mapping, Optional, Tuple, Union

import torch

from . import _shardcast
from ._shardcast import (  # noqa: F401  (re-exported)
    CheckpointError,
    CommError,
    CommTimeout,
    ConfigError,
    InternalError,
    InvalidArgument,
    IoError,
    ManifestMismatch,
    ShardcastError,
    Unsupported,
)
from ._mapping import checkpoint_keys, compositions
from ._pretrained import from_pretrained

__all__ = [
    "prepare", "load", "ShardcastError", "ManifestMismatch", "CheckpointError", "CommTimeout", "CommError",
    "ConfigError", "InvalidArgument", "IoError", "Unsupported", "InternalError",
    "from_pretrained",
]

BufferInit = Callable[[str, torch.Tensor], torch.Tensor]


def _config_json(config) -> str:
    """A config as JSON text: a path, a dict, or a transformers PretrainedConfig."""
    if config is None:
        return "{}"
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            return f.read()
    if isinstance(config, Mapping):
        return json.dumps(dict(config))
    if hasattr(config, "to_dict"):
        return json.dumps(config.to_dict(), default=str)
    raise InvalidArgument(f"config must be a path, a dict or a PretrainedConfig, not {type(config).__name__}")


def _owner(model: torch.nn.Module, name: str) -> Tuple[torch.nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (model.get_submodule(path) if path else model), leaf


def _non_persistent(model: torch.nn.Module):
    for name, buf in model.named_buffers():
        owner, leaf = _owner(model, name)
        if leaf in owner._non_persistent_buffers_set:
            yield name, buf, owner, leaf


def _match(pattern: str, name: str) -> bool:
    import fnmatch
    return fnmatch.fnmatchcase(name, pattern)


def _compute_buffers(model, config_json: str, source: str, device, buffer_init: Optional[Dict[str, BufferInit]]):
    """Fills every non-persistent buffer from its rule; returns {name: note}."""
    notes = {}
    for name, buf, owner, leaf in list(_non_persistent(model)):
        dev = device if device is not None else (buf.device if buf.device.type != "meta" else torch.device("cpu"))
        user = next((fn for pat, fn in (buffer_init or {}).items() if _match(pat, name)), None)
        if user is not None:
            value = user(name, torch.empty(buf.shape, dtype=buf.dtype, device="meta"))
            if tuple(value.shape) != tuple(buf.shape):
                raise ConfigError(f"buffer_init for '{name}' returned shape {tuple(value.shape)}, "
                                  f"expected {tuple(buf.shape)}")
            owner._buffers[leaf] = value.to(device=dev, dtype=buf.dtype)
            notes[name] = "buffer_init"
        elif _shardcast.has_buffer_rule(name):
            out = torch.zeros(buf.shape, dtype=buf.dtype, device=dev)
            notes[name] = _shardcast.init_buffer(config_json, source, name, out)
            owner._buffers[leaf] = out
        elif buf.device.type == "meta":
            raise ConfigError(f"non-persistent buffer '{name}' is on meta and has no init rule: pass "
                              f"buffer_init={{'{name}': fn}} rather than leave it uninitialized")
    return notes


def prepare(model: torch.nn.Module, config=None, target: str = "cpu",
            buffer_init: Optional[Dict[str, BufferInit]] = None) -> dict:
    """The call before `fully_shard`, on a model built under `torch.device("meta")`.

    Parameters stay on meta. Non-persistent buffers (RoPE inv_freq) get real memory on `target` and are
    computed locally from `config` with shardcast's rules, or by `buffer_init={pattern: fn(name, meta)}`
    for buffers no rule covers. Persistent buffers get real, zeroed memory; `load` fills them.
    """
    device = torch.device(target if target != "pinned" else "cpu")
    source = str(config) if isinstance(config, (str, os.PathLike)) else "<config>"
    notes = _compute_buffers(model, _config_json(config), source, device, buffer_init)
    persistent = []
    for name, buf in list(model.named_buffers()):
        owner, leaf = _owner(model, name)
        if leaf in owner._non_persistent_buffers_set:
            continue
        if buf.device.type == "meta":
            owner._buffers[leaf] = torch.zeros(buf.shape, dtype=buf.dtype, device=device)
        persistent.append(name)
    meta = sum(1 for _, p in model.named_parameters() if p.device.type == "meta")
    buffer_bytes = sum(b.numel() * b.element_size() for _, b in model.named_buffers())
    return {"computed_buffers": notes, "persistent_buffers": persistent, "meta_parameters": meta,
            "buffer_bytes": buffer_bytes, "target": target}


def _group(process_group):
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        if process_group is not None:
            raise InvalidArgument("process_group given but torch.distributed is not initialized")
        return None, 0, 1, None, None
    pg = process_group if process_group is not None else dist.distributed_c10d._get_default_group()
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    try:
        backend = pg._get_backend(torch.device("cpu"))
    except Exception:  # an NCCL-only group: shardcast stages through the host, so it needs a CPU one
        backend = dist.new_group(ranks=dist.get_process_group_ranks(pg), backend="gloo")._get_backend(torch.device("cpu"))
    store = dist.distributed_c10d._get_default_store() if process_group is None else None
    return pg, rank, world, backend, store


def _local(param, rank: int, world: int):
    """(local tensor, global shape, replicated) of a parameter, with FSDP2's placement checked."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    if isinstance(param, DTensor):
        placements = tuple(param.placements)
        if placements == (Shard(0),) and param.device_mesh.ndim == 1:
            return param.to_local(), tuple(param.shape), False
        if all(isinstance(p, Replicate) for p in placements):
            return param.to_local(), tuple(param.shape), True
        raise Unsupported(f"placement {placements} on a {param.device_mesh.ndim}-d mesh: only Shard(0) on a 1-d mesh "
                          "and Replicate are supported")
    return param.data if hasattr(param, "data") else param, tuple(param.shape), True


def _tied(model) -> Dict[str, str]:
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "tie_word_embeddings", False):
        names = {n for n, _ in model.named_parameters()}
        if "lm_head.weight" in names and "model.embed_tokens.weight" in names:
            return {"lm_head.weight": "model.embed_tokens.weight"}
    return {}


def load(model: Union[torch.nn.Module, Mapping[str, Tuple[torch.Tensor, int, int]]], path: Union[str, os.PathLike],
         source: str = "rank0", target: Optional[str] = None, verify: bool = False, process_group=None, *,
         config=None, buffer_init: Optional[Dict[str, BufferInit]] = None, chunk_bytes: Optional[int] = None,
         staging_slots: Optional[int] = None, timeout: Optional[float] = None, strict_keys: bool = False) -> dict:
    """The call after `fully_shard`: every rank receives only its own rows of every parameter.

    `model` is an FSDP2-sharded module (DTensor parameters), or an explicit mapping
    {key: (local_tensor, row_begin, row_end)} for users who shard without DTensor; the rows must follow
    FSDP2's dim-0 rule. Parameters still on meta are allocated first (`to_empty`, on `target`), which
    wipes buffers, so non-persistent buffers are then recomputed. Persistent buffers are filled from the
    checkpoint by broadcast. Returns the per-rank report; raises a ShardcastError subclass, the same on
    every rank, on any failure.
    """
    path = os.fspath(path)
    pg, rank, world, backend, store = _group(process_group)
    keys = checkpoint_keys(path)
    options = {"source": source, "verify": verify, "strict_keys": strict_keys}
    if chunk_bytes is not None:
        options["chunk_bytes"] = int(chunk_bytes)
    if staging_slots is not None:
        options["staging_slots"] = int(staging_slots)
    if timeout is not None:
        options["timeout_ms"] = int(timeout * 1000)
    entries = []
    if isinstance(model, Mapping):
        for key, (tensor, begin, end) in model.items():
            shape = keys.get(key)
            if shape is None:
                shape = (end,) + tuple(tensor.shape[1:])  # absent: the manifest check names it
            entries.append((key, tensor, list(shape), "parameter", False, None))
        return _shardcast.load_entries(entries, path, options, backend, store, rank, world)

    device = torch.device(target) if target is not None and target != "pinned" else None
    if any(p.device.type == "meta" for p in model.parameters()) or any(
            b.device.type == "meta" for b in model.buffers()):
        model.to_empty(device=device or torch.device("cpu"))
    # to_empty leaves garbage in buffers: recompute the non-persistent ones, zero the persistent ones
    # (the load fills those).
    cfg = config if config is not None else getattr(model, "config", None)
    _compute_buffers(model, _config_json(cfg), "<config>", None, buffer_init)
    comp = compositions(model, keys)
    for name, param in model.named_parameters():
        local, shape, replicated = _local(param, rank, world)
        entries.append((name, local, list(shape), "parameter", replicated, comp.get(name)))
    non_persistent = {n for n, *_ in _non_persistent(model)}
    for name, buf in model.named_buffers():
        if name not in non_persistent:
            entries.append((name, buf, list(buf.shape), "persistent_buffer", True, comp.get(name)))
    options["tied"] = _tied(model)
    return _shardcast.load_entries(entries, path, options, backend, store, rank, world)
