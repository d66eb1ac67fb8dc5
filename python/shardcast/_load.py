"""load: the call after fully_shard (or with an explicit mapping): every rank receives only its own piece
of every tensor."""
from __future__ import annotations

import os
import warnings
from typing import Dict, Mapping, Optional, Tuple, Union

import torch

from . import _shardcast
from ._exchange import channel, computed_on_rank0, gathered
from ._group import _group, _store_host, operation_store
from ._layouts import _Layouts, _group_ranks, _local
from ._log import logged
from ._materialize import zero_storage
from ._names import named_buffers, named_parameters
from ._mapping import checkpoint_keys, compositions
from ._prepare import (_PREPARED, BufferInit, _compute_buffers, _config_json, _match, _missing_buffers_error,
                       _non_persistent, _pin_buffers, _pinned_host)
from ._carried import _agreed, _problem
from ._mapping_load import _mapping_entries
from ._progress import _progress
from ._report import LoadReport
from ._shardcast import InvalidArgument, IoError, ShardcastError, Unsupported


def _tied(model) -> Dict[str, str]:
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "tie_word_embeddings", False):
        names = {n for n, _ in named_parameters(model)}
        if "lm_head.weight" in names and "model.embed_tokens.weight" in names:
            return {"lm_head.weight": "model.embed_tokens.weight"}
    return {}


# The attribute naming the parameters from_pretrained's stream loaded beside the build: the load after it
# fills only the buffers.
STREAMED = "_shardcast_streamed"

_OPTION_TYPES = (bool, int, float, str)


def _options(**given) -> Dict[str, str]:
    """The keywords the caller gave, as text for the C++ options builder (which also reads SHARDCAST_*
    variables; given keywords win, and it parses them all). None means not given. A value of another
    type (an object, a list) is an InvalidArgument naming its keyword: its str() is nothing to parse."""
    out = {}
    for name, value in given.items():
        if value is None:
            continue
        if not isinstance(value, _OPTION_TYPES):
            raise InvalidArgument(f"{name}=: expected a number or text, got {type(value).__name__}")
        out[name] = ("1" if value else "0") if isinstance(value, bool) else str(value)
    return out


def _timeout_ms(timeout) -> Optional[int]:
    """timeout= seconds as the options' timeout_ms (None: not given)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise InvalidArgument(f"timeout={timeout!r}: expected seconds (a number), got {type(timeout).__name__}")
    return max(1, int(timeout * 1000))


def _timeout_alone(timeout) -> Dict[str, str]:
    """The options of a rank that failed before its operation: the caller's timeout= alone, so it waits for
    the others as long as they wait for it; none where it cannot be read (it may be what failed)."""
    try:
        return _options(timeout_ms=_timeout_ms(timeout))
    except Exception:  # noqa: BLE001 -- the problem this rank carries already, or part of it
        return {}


def _target(target: Optional[str]) -> Optional[str]:
    """Where the shards live: the keyword, else SHARDCAST_TARGET (as for every option, read by the C++ options
    parser), else None (the device follows the mesh; CPU). Resolved before the load, because Python allocates
    the shards (and builds the mesh and the buffers)."""
    if target is not None or not os.environ.get("SHARDCAST_TARGET", "").strip():
        return target
    return _shardcast.load_target({})


def _cuda_device() -> torch.device:
    """This rank's GPU: cuda:LOCAL_RANK (as torchrun and transformers' distributed_config bind it), or the
    current device where no launcher set LOCAL_RANK."""
    local = os.environ.get("LOCAL_RANK", "").strip()
    return torch.device("cuda", int(local) if local.isdigit() else torch.cuda.current_device())


def _device(target: Optional[str]) -> Optional[torch.device]:
    """The device a resolved target allocates on: None for the host (pageable or pinned)."""
    if target == "cuda":
        return _cuda_device()
    return None if target in (None, "cpu", "pinned") else torch.device(target)


def _model_target(model, target: Optional[str], rank: int) -> Optional[str]:
    """The target of a module's load: the device of its DTensors' meshes. A CUDA mesh means "cuda", and a host
    target there ("cpu", "pinned", from target= or SHARDCAST_TARGET) is an InvalidArgument, except where FSDP2
    offloads the parameters to the host (CPUOffloadPolicy: their shards live there, pinned by default)."""
    from ._materialize import cpu_offload
    on_cuda = next((n for n, p in named_parameters(model) if _mesh_type(p) == "cuda"), None)
    if on_cuda is None:
        return target
    offload = cpu_offload(model)
    if offload is not None:
        return target or ("pinned" if offload else "cpu")
    if target in (None, "cuda"):
        return "cuda"
    raise InvalidArgument(f"target {target!r} (target= or SHARDCAST_TARGET) on rank {rank}: parameter '{on_cuda}' "
                          f"is a DTensor on a CUDA device mesh, so its shard lives on {_cuda_device()}; leave "
                          f"target unset (the device follows the mesh) or pass target='cuda'")


def _mesh_type(t) -> Optional[str]:
    mesh = getattr(t, "device_mesh", None)
    return getattr(mesh, "device_type", None)


def _deprecated(old: str, new: str, value, given):
    """The value of an option renamed from `old` to `new` (kept for one release, with a DeprecationWarning);
    both given and different is an InvalidArgument."""
    if value is None:
        return given
    warnings.warn(f"{old} is deprecated and will be removed in the next release: use {new}", DeprecationWarning,
                  stacklevel=3)
    if given is not None and given != value:
        raise InvalidArgument(f"{new}{given!r} and {old}{value!r} disagree: pass {new} only")
    return value


def load(model: Union[torch.nn.Module, Mapping[str, tuple]], path: Union[str, os.PathLike], *,
         source: Optional[str] = None, target: Optional[str] = None, verify: Optional[bool] = None,
         process_group=None, config=None, buffer_init: Optional[Dict[str, BufferInit]] = None,
         chunk_bytes: Optional[Union[int, str]] = None, staging_slots: Optional[int] = None,
         timeout: Optional[float] = None, strict: Optional[bool] = None, progress=None,
         readahead_bytes: Optional[Union[int, str]] = None, strict_keys: Optional[bool] = None,
         read_threads: Optional[int] = None, weight_block_size: Optional[Union[int, str]] = None) -> LoadReport:
    """The call after `fully_shard`: every rank receives only its own rows of every parameter.

    `model` is a module whose parameters are DTensors in any layout (FSDP2, HSDP, TP, EP, 2-D and 3-D
    meshes, _StridedShard, a mesh per parameter), or an explicit mapping for code that shards without
    DTensor: {key: (local_tensor, offsets)}, the box of the global tensor starting at `offsets` with the
    local tensor's shape (any box: uneven, overlapping, empty; every rank gives every key), or
    {key: (local_tensor, row_begin, row_end)}, rows of dim 0 under FSDP2's rule. Parameters still on meta
    are allocated first, on `target`, zero-valued and at no cost (on the host, lazy-zero pages that commit
    only as the stream writes them), which wipes buffers: non-persistent buffers then get back what `prepare` computed (or are computed here).
    Persistent buffers are filled from the checkpoint by broadcast.

    Every rank receives exactly its DTensor's local tensor: Shard(d) on any dim, uneven and empty pieces,
    _StridedShard (FSDP2 over TP), replicas of a piece (HSDP, TP replicas) each receiving the same bytes.

    The model's dtypes decide what a quantized checkpoint becomes: a floating (bf16, f16, f32) parameter
    of an fp8, MXFP4 or NVFP4 weight is dequantized in the stream; a parameter in the quantized layout
    (transformers' FP8Linear/FP8Experts or Mxfp4GptOssExperts, see from_pretrained(keep_quantized=True))
    receives the fp8 weight and its scale grid, or the MXFP4 blocks and their scales, as they are stored.

    target: where this rank's shards live; None (default): the device of the model's DTensor meshes, so a
    CUDA mesh loads into cuda:LOCAL_RANK and a CPU mesh into host memory ("pinned": page-locked host memory).
    A host target into a CUDA mesh is an InvalidArgument on every rank, except for parameters FSDP2 offloads
    to the host (CPUOffloadPolicy).

    Every argument after `path` is keyword-only. Options (None: SHARDCAST_* from the environment, else the
    default): source "auto" (default: rank 0 decides, and the report's "source_reason" says why: each-rank when every rank sees the checkpoint on
    one node; node-leader, or striped for HSDP, on several nodes; rank0 when only rank 0 sees it), "rank0",
    "each-rank", "node-leader" (the first rank of each node reads its node's rows) or "striped" (each
    shard's rows read once, by one of its replicas); chunk_bytes (64 MiB, 8 MiB for a CUDA target; an int or "64M"); staging_slots (4, 8 for a CUDA target); timeout seconds (600);
    verify (False); strict (False); readahead_bytes (256M a node, split over its reading ranks: 64M each for
    each-rank at 4 ranks a node); read_threads (threads reading this rank's bytes, each a whole chunk at a
    time: the rank's share of the CPUs, its own where the launcher binds it, else the node's over its
    reading ranks, within a cgroup quota; 1 to 4 (8 for a CUDA target) and at most staging_slots);
    weight_block_size (an fp8 checkpoint's scale blocks, 128 or "128x64": for a checkpoint whose config.json
    does not say; one that names another block is an InvalidArgument).
    `shardcast options` prints the table of them all, with their SHARDCAST_* variables. Rank 0's chunk_bytes, staging_slots and source are used by every
    rank; verify and strict must match on every rank. progress: True for a progress line on rank 0
    (tqdm where installed), False for none, or a callable(done_bytes, total_bytes) called on this rank;
    None (default): the line on rank 0 when its stderr is a terminal.

    Parameter and buffer names are paired with checkpoint keys without the levels torch.compile
    (`_orig_mod.`), checkpoint_wrapper (`_checkpoint_wrapped_module.`) and FSDP1 (`_fsdp_wrapped_module.`)
    add, as DCP pairs them: a compiled, activation-checkpointed model loads the plain model's checkpoint.

    strict has `load_state_dict(strict=True)`'s meaning: every checkpoint key must be used (an unused one
    is a ManifestMismatch naming it, on every rank), and every model key present. Unlike load_state_dict,
    a model key the checkpoint lacks is an error whatever strict says (a shard left unloaded would be
    garbage), so strict=False (the default, SHARDCAST_STRICT_KEYS) only skips the checkpoint's extra keys
    (sidecar tensors, old buffers), counted in the report's "skipped_keys". strict_keys= is its deprecated
    old name (a DeprecationWarning; removed in the next release).

    Returns a LoadReport (per-rank rows, seconds, gbps, peaks; `report["key"]` and `to_dict()` give the
    dict of earlier releases); raises a ShardcastError subclass, the same on every rank, on any failure:
    one found on this rank alone before the ranks agree (a bad argument or SHARDCAST_* variable, a bad
    mapping, an allocation) is carried into the agreement, so every rank raises it at once, naming this rank.
    """
    # Without its group this rank has no one to tell: the one step that may fail here alone.
    pg, rank, world, store = _group(process_group)
    mapping = isinstance(model, Mapping)
    # From here to the handshake, a failure on this rank is carried into it, and this rank still makes
    # every exchange a load makes (the per-group counters of _exchange.py and _group.py stay in step).
    try:
        path = os.fspath(path)
        target = _target(target)
        if not mapping:
            target = _model_target(model, target, rank)
        strict = _deprecated("strict_keys=", "strict=", strict_keys, strict)
        options = _options(source=source, target=target if target not in (None, "pinned") else None, verify=verify,
                           strict_keys=strict, chunk_bytes=chunk_bytes, staging_slots=staging_slots,
                           readahead_bytes=readahead_bytes, read_threads=read_threads,
                           weight_block_size=weight_block_size, timeout_ms=_timeout_ms(timeout))
        progress = _progress(progress, rank)
    except Exception as e:  # noqa: BLE001 -- any failure here must reach every rank, not only this one
        return _fail_load(pg, rank, world, store, _problem(e), mapping, timeout)
    timeout_s = _shardcast.load_timeout_seconds(options)
    ch = channel(pg, store)
    if mapping:
        entries, layouts, problem = _mapping_entries(model, path, ch, rank, world, timeout_s)
        tied = {}
    else:
        entries, layouts, problem, tied = _module_entries(model, path, target, config, buffer_init, pg, ch, rank,
                                                          world, timeout_s)
    ops = operation_store(pg, store)  # numbered on every path, _agreed's shortcut too
    return logged("load", path, rank, LoadReport.from_dict(_agreed(problem, lambda: _shardcast.load_entries(
        entries, layouts.table, path, options, tied, ops, rank, world, progress, problem,
        _store_host(store) if store is not None else ""))))


def _fail_load(pg, rank: int, world: int, store, problem: Tuple[str, str], mapping: bool, timeout=None) -> dict:
    """This rank's share of a load that already failed here, before anything was exchanged: the
    exchanges a load of this kind makes (a module: rank 0's compositions; a mapping: also every rank's
    boxes), rank 0 telling the others at once that it has nothing, then the handshake with `problem`,
    whose verdict raises it on every rank. Never returns. timeout: the caller's timeout= (seconds), so this
    rank waits for the others as long as they wait for it; the default's where it cannot be read (it may
    be what failed)."""
    options = _timeout_alone(timeout)
    timeout_s = _shardcast.load_timeout_seconds(options)
    ch = channel(pg, store)

    def failed():
        raise InvalidArgument(problem[1])

    try:
        computed_on_rank0(ch, rank, world, failed, timeout_s)
    except Exception:  # noqa: BLE001 -- rank 0's own failure, or a peer that never answered: the handshake says
        pass
    if mapping:
        try:
            gathered(ch, rank, world, None, timeout_s)  # None: "this rank failed", so no peer adds a problem of its own
        except Exception:  # noqa: BLE001
            pass
    ops = operation_store(pg, store)  # numbered on every path, _agreed's shortcut too
    return _agreed(problem, lambda: _shardcast.load_entries(
        [], [], "", options, {}, ops, rank, world, None, problem, _store_host(store) if store is not None else ""))


def _module_entries(model, path, target, config, buffer_init, pg, ch, rank, world, timeout_s):
    """(entries, layouts, problem, tied) of a module: its parameters and persistent buffers, allocated.
    Anything that fails on this rank is the problem, carried into the handshake; a rank that hears that
    rank 0 failed enters it with nothing (rank 0's problem is the verdict; nothing to allocate)."""
    entries, layouts = [], _Layouts()
    try:
        # Which checkpoint tensors make each fused entry: read and worked out by rank 0 only, and asked
        # for first on every rank, so the ranks' calls stay paired whatever fails after.
        comp = computed_on_rank0(ch, rank, world, lambda: _compositions(model, path), timeout_s)
        if comp is None:  # rank 0 failed, and carries its problem into the handshake
            return [], _Layouts(), None, {}
        _materialize_or_raise(model, target, config, buffer_init)
        group_ranks = _group_ranks(pg, world)
        streamed = getattr(model, STREAMED, frozenset())  # loaded already, beside the build (_stream.py)
        for name, param in named_parameters(model):
            if name in streamed:
                continue
            local, shape, layout = _local(param, f"'{name}'", group_ranks, layouts.meshes)
            entries.append((name, local, list(shape), "parameter", layouts.index(layout), comp.get(name)))
        non_persistent = {n for n, *_ in _non_persistent(model)}
        for name, buf in named_buffers(model):
            if name not in non_persistent:
                local, shape, layout = _local(buf, f"'{name}'", group_ranks, layouts.meshes)
                entries.append((name, local, list(shape), "persistent_buffer", layouts.index(layout), comp.get(name)))
        return entries, layouts, None, _tied(model)
    except Exception as e:  # noqa: BLE001 -- any failure here must reach every rank, not only this one
        return [], _Layouts(), _problem(e), {}


def _materialize_or_raise(model, target, config, buffer_init) -> None:
    try:
        _materialize(model, target, config, buffer_init)
    except ShardcastError:
        raise
    except Exception as e:  # noqa: BLE001 -- the allocator, or a device this rank cannot use
        raise IoError(f"cannot allocate this rank's shards on {target or 'cpu'}: {type(e).__name__}: {e}") from e


def _compositions(model, path: str) -> Dict[str, list]:
    """{model key: [checkpoint keys]} for the entries the checkpoint stores under other keys. A name the
    checkpoint holds loads as itself whatever transformers' conversion rules say (compositions passes it by),
    so where it holds every name the load reads, nothing composes and the rules are not asked for:
    transformers builds every model type's rules at their first use (0.06 s on the dev VM, once a process).
    Reading the keys costs rank 0 one pass over the headers, which the engine reads next anyway: milliseconds
    for a few thousand keys in the page cache, most of a second for ~90k keys in 163 files.
    Only parameters' and persistent buffers' names may be looked up in the result (no other name is checked)."""
    keys = checkpoint_keys(path)
    non_persistent = {n for n, *_ in _non_persistent(model)}
    loaded = [n for n, _ in named_parameters(model)] + [n for n, _ in named_buffers(model) if n not in non_persistent]
    if all(n in keys for n in loaded):
        return {}
    return compositions(model, keys)


def _materialize(model: torch.nn.Module, target: Optional[str], config, buffer_init) -> None:
    """Gives meta parameters their local storage, zero-valued at no cost (_materialize.zero_storage: lazy-zero
    on the host, nothing committed until the stream writes), then restores the non-persistent buffers that
    wiped: prepare's values, else buffer_init, else shardcast's rules. A buffer with none of these is a
    ConfigError naming every such buffer."""
    pinned = _pinned_host(target)
    device = _device(target)
    prepared = getattr(model, _PREPARED, None) or {}
    keep = dict(prepared.get("buffers", {}))
    for name, buf, _, _ in _non_persistent(model):  # values set since prepare (or without it) win
        if buf.device.type != "meta":
            keep[name] = buf.detach().clone()
    inits = dict(prepared.get("buffer_init", {}))
    inits.update(buffer_init or {})
    for name in list(keep):  # a buffer_init given to load itself beats what was computed before
        if any(_match(pat, name) for pat in (buffer_init or {})):
            del keep[name]
    if any(p.device.type == "meta" for p in model.parameters()) or any(
            b.device.type == "meta" for b in model.buffers()):
        if pinned:  # every new tensor (a DTensor's local shard too) in pinned memory, zero-valued: page-locked
            # memory is committed when it is pinned, so zeroing costs one memset and nothing unwritten
            # (FSDP2's padding past a rank's rows) is left as garbage
            model._apply(lambda t: torch.empty_like(t, device="cpu", pin_memory=True).zero_())
        else:
            zero_storage(model, device or torch.device("cpu"))
    cfg = config if config is not None else getattr(model, "config", None)
    _, missing = _compute_buffers(model, _config_json(cfg), "<config>", None, inits, keep)
    if missing:
        raise _missing_buffers_error(missing)
    if pinned:
        _pin_buffers(model)
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if not local.is_pinned():
                raise Unsupported(f'target="pinned": parameter \'{name}\' was allocated in pageable memory')
