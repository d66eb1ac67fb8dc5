"""load: the call after fully_shard (or with an explicit mapping): every rank receives only its own piece
of every tensor."""
from __future__ import annotations

import os
from typing import Dict, Mapping, Optional, Union

import torch

from . import _shardcast
from ._exchange import channel, computed_on_rank0, gathered
from ._group import _group, _store_host, operation_store
from ._layouts import _Layouts, _group_ranks, _local
from ._log import logged
from ._mapping import checkpoint_keys, compositions, conversion_rules, entry_shape
from ._prepare import (_PREPARED, BufferInit, _compute_buffers, _config_json, _match, _missing_buffers_error,
                       _non_persistent, _pin_buffers, _pinned_host)
from ._shardcast import InvalidArgument, IoError, ShardcastError, Unsupported


def _tied(model) -> Dict[str, str]:
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "tie_word_embeddings", False):
        names = {n for n, _ in model.named_parameters()}
        if "lm_head.weight" in names and "model.embed_tokens.weight" in names:
            return {"lm_head.weight": "model.embed_tokens.weight"}
    return {}


def _options(**given) -> Dict[str, str]:
    """The keywords the caller gave, as text for the C++ options builder (which also reads SHARDCAST_*
    variables; given keywords win). None means not given."""
    out = {}
    for name, value in given.items():
        if value is None:
            continue
        out[name] = ("1" if value else "0") if isinstance(value, bool) else str(value)
    return out


def _target(target: Optional[str]) -> Optional[str]:
    """Where the shards live: the keyword, else SHARDCAST_TARGET (as for every option), else None (CPU).
    Resolved once, in Python, because Python allocates them (and builds the mesh and the buffers)."""
    if target is not None:
        return target
    env = os.environ.get("SHARDCAST_TARGET", "").strip()
    if not env:
        return None
    if env not in ("cpu", "pinned", "cuda"):
        raise InvalidArgument(f"SHARDCAST_TARGET={env!r} is not a target (cpu, pinned or cuda)")
    return env


def _progress_printer():
    """The CLI's progress line on stderr (or a tqdm bar where tqdm is installed), for rank 0."""
    import sys
    import time
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    state = {"bar": None, "t0": None}

    def show(done: int, total: int):
        if tqdm is not None:
            if state["bar"] is None:
                state["bar"] = tqdm(total=total, unit="B", unit_scale=True, desc="shardcast load")
            state["bar"].update(done - state["bar"].n)
            if done >= total:
                state["bar"].close()
            return
        now = time.monotonic()
        state["t0"] = state["t0"] or now
        secs = max(now - state["t0"], 1e-9)
        gbs = done / secs / 1e9
        eta = (total - done) / 1e9 / gbs if gbs > 0 else 0.0
        sys.stderr.write(f"\rshardcast load: {done / 2**30:.2f} / {total / 2**30:.2f} GiB ({100 * done / max(total, 1):.0f}%) "
                         f"{gbs:.2f} GB/s ETA {eta:.1f} s" + ("\n" if done >= total else ""))
        sys.stderr.flush()
    return show


def load(model: Union[torch.nn.Module, Mapping[str, tuple]], path: Union[str, os.PathLike],
         source: Optional[str] = None, target: Optional[str] = None, verify: Optional[bool] = None,
         process_group=None, *, config=None, buffer_init: Optional[Dict[str, BufferInit]] = None,
         chunk_bytes: Optional[Union[int, str]] = None, staging_slots: Optional[int] = None,
         timeout: Optional[float] = None, strict_keys: Optional[bool] = None, progress=None,
         readahead_bytes: Optional[Union[int, str]] = None) -> dict:
    """The call after `fully_shard`: every rank receives only its own rows of every parameter.

    `model` is a module whose parameters are DTensors in any layout (FSDP2, HSDP, TP, EP, 2-D and 3-D
    meshes, _StridedShard, a mesh per parameter), or an explicit mapping for code that shards without
    DTensor: {key: (local_tensor, offsets)}, the box of the global tensor starting at `offsets` with the
    local tensor's shape (any box: uneven, overlapping, empty; every rank gives every key), or
    {key: (local_tensor, row_begin, row_end)}, rows of dim 0 under FSDP2's rule. Parameters still on meta are allocated first (`to_empty`, on `target`), which
    wipes buffers: non-persistent buffers then get back what `prepare` computed (or are computed here).
    Persistent buffers are filled from the checkpoint by broadcast.

    Every rank receives exactly its DTensor's local tensor: Shard(d) on any dim, uneven and empty pieces,
    _StridedShard (FSDP2 over TP), replicas of a piece (HSDP, TP replicas) each receiving the same bytes.

    The model's dtypes decide what a quantized checkpoint becomes: a floating (bf16, f16, f32) parameter
    of an fp8, MXFP4 or NVFP4 weight is dequantized in the stream; a parameter in the quantized layout
    (transformers' FP8Linear/FP8Experts or Mxfp4GptOssExperts, see from_pretrained(keep_quantized=True))
    receives the fp8 weight and its scale grid, or the MXFP4 blocks and their scales, as they are stored.

    Options (None: SHARDCAST_* from the environment, else the default): source "auto" (default: rank 0
    decides, and the report's "source_reason" says why: each-rank when every rank sees the checkpoint on
    one node; node-leader, or striped for HSDP, on several nodes; rank0 when only rank 0 sees it), "rank0",
    "each-rank", "node-leader" (the first rank of each node reads its node's rows) or "striped" (each
    shard's rows read once, by one of its replicas); chunk_bytes (64 MiB; an int or "64M"); staging_slots (4); timeout seconds (600);
    verify (False); strict_keys (False); readahead_bytes (256M for rank0 and node-leader, 0 for the others).
    `shardcast options` prints the table of them all, with their SHARDCAST_* variables. Rank 0's chunk_bytes, staging_slots and source are used by every
    rank; verify and strict_keys must match on every rank. progress: True for a progress line on rank 0
    (tqdm where installed), or a callable(done_bytes, total_bytes) called on this rank.

    Returns the per-rank report; raises a ShardcastError subclass, the same on every rank, on any failure.
    """
    path = os.fspath(path)
    target = _target(target)
    pg, rank, world, store = _group(process_group)
    options = _options(source=source, target=target if target not in (None, "pinned") else None, verify=verify,
                       strict_keys=strict_keys, chunk_bytes=chunk_bytes, staging_slots=staging_slots,
                       readahead_bytes=readahead_bytes,
                       timeout_ms=None if timeout is None else max(1, int(timeout * 1000)))
    if progress is True:
        progress = _progress_printer() if rank == 0 else None
    elif progress is False:
        progress = None
    entries, layouts = [], _Layouts()
    timeout_s = _shardcast.load_timeout_seconds(options) or 600.0
    ch = channel(pg, store)
    if isinstance(model, Mapping):
        entries, layouts, problem = _mapping_entries(model, path, ch, rank, world, timeout_s)
        return logged("load", path, rank, _shardcast.load_entries(
            entries, layouts.table, path, options, {}, operation_store(pg, store), rank,
            world, progress, problem, _store_host(store) if store is not None else ""))

    # Anything that fails on this rank from here on is carried into the handshake, so every rank
    # raises it instead of waiting for this one in a collective.
    try:
        # Which checkpoint tensors make each fused entry: read and worked out by rank 0 only, and asked
        # for first on every rank, so the ranks' calls stay paired whatever fails after.
        comp = computed_on_rank0(ch, rank, world, lambda: _compositions(model, path), timeout_s) or {}
        _materialize_or_raise(model, target, config, buffer_init)
        group_ranks = _group_ranks(pg, world)
        for name, param in model.named_parameters():
            local, shape, layout = _local(param, f"'{name}'", group_ranks)
            entries.append((name, local, list(shape), "parameter", layouts.index(layout), comp.get(name)))
        non_persistent = {n for n, *_ in _non_persistent(model)}
        for name, buf in model.named_buffers():
            if name not in non_persistent:
                local, shape, layout = _local(buf, f"'{name}'", group_ranks)
                entries.append((name, local, list(shape), "persistent_buffer", layouts.index(layout), comp.get(name)))
        problem = None
    except Exception as e:  # noqa: BLE001 -- any failure here must reach every rank, not only this one
        kind = type(e).__name__ if isinstance(e, ShardcastError) else "InternalError"
        problem = (kind, str(e) if isinstance(e, ShardcastError) else f"{type(e).__name__}: {e}")
        entries, layouts = [], _Layouts()
    return logged("load", path, rank, _shardcast.load_entries(
        entries, layouts.table, path, options, _tied(model), operation_store(pg, store),
        rank, world, progress, problem, _store_host(store) if store is not None else ""))


def _materialize_or_raise(model, target, config, buffer_init) -> None:
    try:
        _materialize(model, target, config, buffer_init)
    except ShardcastError:
        raise
    except Exception as e:  # noqa: BLE001 -- to_empty: the allocator, or a device this rank cannot use
        raise IoError(f"cannot allocate this rank's shards on {target or 'cpu'}: {type(e).__name__}: {e}") from e


def _mapping_entries(mapping, path, ch, rank, world, timeout_s):
    """The entries of an explicit mapping, every value either (local, row_begin, row_end): rows of dim 0
    under FSDP2's rule, or (local, offsets): the box of the global tensor at `offsets` with the local
    tensor's shape, any box (every rank's boxes are gathered, so each knows what the others hold). A
    problem is carried into the handshake, so every rank raises it."""
    problem, entries, layouts = None, [], _Layouts()
    try:  # the checkpoint's shape of every key: read by rank 0 only
        floating = {k: v[0].is_floating_point() for k, v in mapping.items()}
        shapes = computed_on_rank0(ch, rank, world, lambda: _mapping_shapes(path, floating), timeout_s) or {}
    except Exception as e:  # noqa: BLE001 -- carried into the handshake, where every rank raises it
        shapes, problem = {}, ("InternalError", f"{type(e).__name__}: {e}")
    mine = {}
    for key, value in mapping.items():
        if len(value) == 2:
            tensor, offsets = value
            mine[key] = [[int(x) for x in offsets], [int(x) for x in tensor.shape]]
    try:
        boxes = gathered(ch, rank, world, mine, timeout_s)
    except Exception as e:  # noqa: BLE001 -- carried into the handshake
        boxes, problem = [mine] * world, problem or ("InternalError", f"{type(e).__name__}: {e}")
    for key, value in mapping.items():
        tensor = value[0]
        if len(value) == 2:
            shape = shapes.get(key)
            if shape is None:  # absent: the manifest check names it
                shape = [o + n for o, n in zip(*mine[key])]
            holders = [r for r in range(world) if key in boxes[r]]
            if len(holders) != world and problem is None:
                problem = ("InvalidArgument", f"key '{key}' is given as a box on ranks {holders} but not on the "
                           f"others: every rank gives every key in the same form (an empty box for nothing)")
            layout = ((), tuple(holders), (), tuple((tuple(boxes[r][key][0]), tuple(boxes[r][key][1])) for r in holders))
            entries.append((key, tensor, list(shape), "parameter", layouts.index(layout), None))
            continue
        _, begin, end = value
        shape = shapes.get(key)
        if shape is None:
            shape = (end,) + tuple(tensor.shape[1:])  # absent: the manifest check names it
        rows = shape[0] if shape else 1
        chunk = -(-rows // world)  # FSDP2's dim-0 rule for this rank
        want = (min(rows, rank * chunk), min(rows, rank * chunk + chunk))
        if (begin, end) != want and problem is None:  # agreed in the handshake: every rank raises it
            problem = ("InvalidArgument", f"key '{key}' on rank {rank}: rows [{begin}, {end}) given, but FSDP2's "
                       f"dim-0 rule gives this rank [{want[0]}, {want[1]}) of {rows} over {world} ranks")
        entries.append((key, tensor, list(shape), "parameter", -2, None))
    if problem is not None:
        entries, layouts = [], _Layouts()
    return entries, layouts, problem


def _mapping_shapes(path: str, keys: Dict[str, bool]) -> Dict[str, list]:
    """{key: shape} of the keys given as {key: whether the entry is floating}."""
    found = checkpoint_keys(path)
    return {k: list(s) for k, floating in keys.items() if (s := entry_shape(found, k, floating)) is not None}


def _compositions(model, path: str) -> Dict[str, list]:
    # A model type without conversion rules or packed (uint8) parameters composes nothing: the
    # checkpoint is not even read.
    if not conversion_rules(model) and not any(p.dtype == torch.uint8 for p in model.parameters()):
        return {}
    return compositions(model, checkpoint_keys(path))


def _materialize(model: torch.nn.Module, target: Optional[str], config, buffer_init) -> None:
    """Gives meta parameters their local storage (to_empty), then restores the non-persistent buffers
    to_empty wiped: prepare's values, else buffer_init, else shardcast's rules. A buffer with none of
    these is a ConfigError naming every such buffer."""
    pinned = _pinned_host(target)
    device = torch.device(target) if target is not None and not pinned else None
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
        if pinned:  # to_empty, with every new tensor (a DTensor's local shard too) in pinned memory
            model._apply(lambda t: torch.empty_like(t, device="cpu", pin_memory=True))
        else:
            model.to_empty(device=device or torch.device("cpu"))
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
