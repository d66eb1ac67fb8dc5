"""prepare: the call before fully_shard. Parameters stay on meta; non-persistent buffers are computed
locally (shardcast's rules, or buffer_init); persistent buffers get zeroed memory for load to fill."""
from __future__ import annotations

import json
import os
from typing import Callable, Dict, Mapping, Optional, Tuple

import torch

from . import _shardcast
from ._materialize import zeros
from ._shardcast import ConfigError, InvalidArgument, Unsupported

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
    """(name, buffer, owner, leaf) of every non-persistent buffer; the name without wrappers' levels
    (_names.fqn), as buffer_init patterns and prepare's values know it."""
    from ._names import fqn
    for name, buf in model.named_buffers():
        owner, leaf = _owner(model, name)
        if leaf in owner._non_persistent_buffers_set:
            yield fqn(name), buf, owner, leaf


def _match(pattern: str, name: str) -> bool:
    import fnmatch
    return fnmatch.fnmatchcase(name, pattern)


def _compute_buffers(model, config_json: str, source: str, device, buffer_init: Optional[Dict[str, BufferInit]],
                     keep: Optional[Dict[str, torch.Tensor]] = None):
    """Fills every non-persistent buffer: from `keep` (values computed earlier, e.g. by prepare), else
    from `buffer_init`, else from shardcast's rule. Returns ({name: note}, [names with no value])."""
    notes, missing = {}, []
    for name, buf, owner, leaf in list(_non_persistent(model)):
        dev = device if device is not None else (buf.device if buf.device.type != "meta" else torch.device("cpu"))
        user = next((fn for pat, fn in (buffer_init or {}).items() if _match(pat, name)), None)
        if keep is not None and name in keep:
            owner._buffers[leaf] = keep[name].to(device=dev)
            notes[name] = "kept from prepare"
        elif user is not None:
            value = _user_value(user, name, buf)
            if tuple(value.shape) != tuple(buf.shape):
                raise ConfigError(f"buffer_init for '{name}' returned shape {tuple(value.shape)}, "
                                  f"expected {tuple(buf.shape)}")
            owner._buffers[leaf] = value.to(device=dev, dtype=buf.dtype)
            notes[name] = "buffer_init"
        elif _shardcast.has_buffer_rule(name):
            out = torch.zeros(buf.shape, dtype=buf.dtype, device=dev)
            try:
                notes[name] = _shardcast.init_buffer(config_json, source, name, out)
            except ConfigError as e:  # a rule matched the name but cannot compute it (a rope type it lacks)
                raise ConfigError(f"non-persistent buffer '{name}': {e}. Pass buffer_init={{pattern: fn(name, "
                                  f"meta_tensor) -> tensor}} to shardcast.prepare() (it survives to load) or to "
                                  f"shardcast.load() for it") from None
            owner._buffers[leaf] = out
        elif buf.device.type == "meta" or keep is not None:
            missing.append(name)
    return notes, missing


def _user_value(user: BufferInit, name: str, buf: torch.Tensor) -> torch.Tensor:
    """What the caller's buffer_init gives for buffer `name`: a ConfigError naming the buffer when the
    callable raises or returns no tensor (the caller's exception chained: the traceback is theirs)."""
    try:
        value = user(name, torch.empty(buf.shape, dtype=buf.dtype, device="meta"))
    except Exception as e:  # noqa: BLE001 -- the caller's code: any failure is a configuration error
        raise ConfigError(f"buffer_init for non-persistent buffer '{name}' raised {type(e).__name__}: {e}") from e
    if not isinstance(value, torch.Tensor):
        raise ConfigError(f"buffer_init for non-persistent buffer '{name}' returned {type(value).__name__}, "
                          f"expected a tensor of shape {tuple(buf.shape)}")
    return value


def _missing_buffers_error(missing) -> ConfigError:
    names = ", ".join(f"'{n}'" for n in missing)
    return ConfigError(f"{len(missing)} non-persistent buffer(s) have no value and no init rule: {names}. Pass "
                       f"buffer_init={{pattern: fn(name, meta_tensor) -> tensor}} to shardcast.prepare() (it "
                       f"survives to load) or to shardcast.load(), rather than leave them uninitialized")


def _keep_fp32(model) -> list:
    """Applies the model class's `_keep_in_fp32_modules_strict` the way transformers' from_pretrained
    does (glob patterns searched in each name; only bf16/f16 entries are upcast). Returns the names."""
    patterns = getattr(model, "_keep_in_fp32_modules_strict", None)
    if not patterns:
        return []
    import re
    regex = re.compile("|".join(f"(?:{p.replace('*', '.*')})" for p in patterns))
    kept = []
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.dtype not in (torch.bfloat16, torch.float16) or not regex.search(name):
            continue
        owner, leaf = _owner(model, name)
        if leaf in owner._parameters:
            owner._parameters[leaf] = torch.nn.Parameter(t.to(torch.float32), requires_grad=t.requires_grad)
        else:
            owner._buffers[leaf] = t.to(torch.float32)
        kept.append(name)
    return kept


_PREPARED = "_shardcast_prepared"  # attribute on the model: what prepare computed, for load


def prepare(model: torch.nn.Module, config=None, target: str = "cpu",
            buffer_init: Optional[Dict[str, BufferInit]] = None) -> dict:
    """The call before `fully_shard`, on a model built under `torch.device("meta")`.

    Parameters stay on meta. Non-persistent buffers (RoPE inv_freq) get real memory on `target` and are
    computed locally from `config` with shardcast's rules, or by `buffer_init={pattern: fn(name, meta)}`
    for buffers no rule covers; `load` keeps these values (its materialization would wipe them). Persistent
    buffers get real, zeroed memory; `load` fills them. Entries the model class keeps in fp32
    (`_keep_in_fp32_modules_strict`, e.g. DeepSeek-V3's `e_score_correction_bias`) are made fp32, as
    `from_pretrained` does. A ConfigError names every buffer that has no value, all at once.
    """
    pinned = _pinned_host(target)
    device = torch.device("cpu" if pinned else target)
    source = str(config) if isinstance(config, (str, os.PathLike)) else "<config>"
    kept_fp32 = _keep_fp32(model)
    notes, missing = _compute_buffers(model, _config_json(config), source, device, buffer_init)
    if missing:
        raise _missing_buffers_error(missing)
    persistent = []
    for name, buf in list(model.named_buffers()):
        owner, leaf = _owner(model, name)
        if leaf in owner._non_persistent_buffers_set:
            continue
        if buf.device.type == "meta":
            owner._buffers[leaf] = zeros(buf.shape, buf.dtype, device)
        persistent.append(name)
    if pinned:
        _pin_buffers(model)
    snapshot = {name: buf.detach().clone() for name, buf, _, _ in _non_persistent(model)}
    object.__setattr__(model, _PREPARED, {"buffers": snapshot, "buffer_init": dict(buffer_init or {})})
    meta = sum(1 for _, p in model.named_parameters() if p.device.type == "meta")
    buffer_bytes = sum(b.numel() * b.element_size() for _, b in model.named_buffers())
    return {"computed_buffers": notes, "persistent_buffers": persistent, "meta_parameters": meta,
            "buffer_bytes": buffer_bytes, "kept_fp32": kept_fp32, "target": target}


def _pinned_host(target: Optional[str]) -> bool:
    """Whether `target` asks for pinned host memory. Pinned (page-locked) memory is registered with the
    CUDA driver, so where this rank has no CUDA it is Unsupported, never silently pageable."""
    if target != "pinned":
        return False
    if not torch.cuda.is_available():
        raise Unsupported('target="pinned": pinned host memory needs CUDA, and torch.cuda.is_available() is False '
                          'on this rank; use target="cpu" (pageable) here')
    return True


def _pin_buffers(model: torch.nn.Module) -> None:
    for name, buf in list(model.named_buffers()):
        if buf.device.type == "cpu" and not buf.is_pinned():
            owner, leaf = _owner(model, name)
            owner._buffers[leaf] = buf.pin_memory()
