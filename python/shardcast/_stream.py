"""from_pretrained's stream beside the build: the checkpoint's bytes land while Python builds the model.

Under the default FSDP layout (fully_shard over a 1-d mesh of the whole world: Shard(0), torch.chunk rows,
FSDP2's padded sharded buffer) each rank's pieces follow from the checkpoint's header and the world size
alone:

    header: key, shape [n, ...]  -->  rank r of W holds rows [r*c, min(n, r*c + c)), c = ceil(n / W)
    padded buffer (lazy zero; GPU)    [ row r*c | ... | last row | pad ... pad ]   (c rows)
    local tensor (the DTensor's)      <---- narrow(0, 0, rows) ---->

Fused MoE experts (transformers' MergeModulelist [+ Concatenate] converters) are planned from the
per-expert keys, in the order the load composes them. So the stream starts on a thread of its own as
soon as the config and the header are read, and runs without the GIL (the C++ load, over a Gloo group of
its own made from this operation's store), while this thread imports the modeling module, builds the meta
model and applies fully_shard:

    main:    config | agree | plan, agree | import, build, layout | check | join | verdict | adopt, buffers
    stream:                               | handshake, rows into the padded buffers ->|

Agreed, never assumed (_stream_rules.py): every rank says whether it may stream (one store exchange, which
every rank makes whatever its reasons), then, where all may, every rank plans and all say whether their
plans came out (a second one); one rank that cannot (a layout it cannot predict, a header it cannot read,
a failure before, a node whose ranks have fewer than two CPUs each where the caller left the choice to the
cores) and none does, and from_pretrained takes its sequential path. After the build, every rank checks its
model against the plan (every planned parameter with that shape and placement, in a padded buffer of that
size, over the whole world in rank order) and hears the stream's outcome; one exchange, decided on rank 0,
makes any rank's problem the same error on every rank, before any buffer becomes a parameter's. Then the
buffers become the parameters' sharded data (no copy). The non-persistent buffers are prepare's, untouched.
Where the model has persistent buffers, parameters its class keeps in another dtype (transformers'
`_keep_in_fp32_modules_strict`: a router's weight, which the header cannot foresee), or parameters under
a name the header does not hold (a tied lm_head that transformers' FSDP unties), the same on every rank
and agreed in that exchange, a small load fills them from the checkpoint after the build.
Every wait has the load's timeout.

For target "cuda" (from_pretrained's default where the job runs on GPUs) the buffers are zeros on the
rank's GPU, the C++ load stages through its page-locked ring and copies each slot to the device, and the
mesh is the whole world on CUDA; the rest is the same.
"""
from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import _shardcast

logger = logging.getLogger("shardcast")

# checkpoint dtypes that load as the model's floating dtype
_FLOATING = ("F64", "F32", "F16", "BF16")


def device_of(target: Optional[str]) -> torch.device:
    """Where the stream's buffers live: this rank's current GPU for target "cuda" (from_pretrained made
    cuda:LOCAL_RANK current), else the host."""
    return torch.device("cuda", torch.cuda.current_device()) if target == "cuda" else torch.device("cpu")


class Planned:
    """One parameter the stream fills: its global shape, its dtype, the checkpoint keys it is made of
    (None: its own key) and this rank's padded buffer (lazy zeros on the host, zeros on a GPU) and local
    rows of it."""

    def __init__(self, key: str, shape: Tuple[int, ...], dtype: torch.dtype, compose: Optional[List[str]],
                 rank: int, world: int, device: torch.device = torch.device("cpu")):
        from ._materialize import zeros
        self.key, self.shape, self.dtype, self.compose = key, tuple(shape), dtype, compose
        chunk = -(-shape[0] // world)  # torch.chunk's rows per rank; the trailing ranks hold fewer or none
        begin, end = min(shape[0], rank * chunk), min(shape[0], rank * chunk + chunk)
        self.padded = zeros((chunk,) + self.shape[1:], dtype, device)
        self.local = self.padded.narrow(0, 0, end - begin)

    def entry(self) -> tuple:
        """The C++ load's entry: -2 is FSDP2's Shard(0) over the whole group."""
        return (self.key, self.local, list(self.shape), "parameter", -2, self.compose)


def plan(path: str, config, dtype: torch.dtype, rank: int, world: int,
         device: torch.device = torch.device("cpu")) -> Dict[str, Planned]:
    """Every parameter the checkpoint's header implies, with this rank's buffers on `device`. Raises Unsupported for a
    checkpoint whose entries the header alone does not give (quantized, renamed keys, integer tensors, a
    conversion other than stacking experts, a scalar)."""
    from ._mapping import _renamed_keys, conversion_rules, expert_merges
    if getattr(config, "quantization_config", None) is not None:
        raise _shardcast.Unsupported("a quantized checkpoint (dequantized shapes and scales)")
    tensors = _shardcast.checkpoint_tensors(path)
    keys = {key: tuple(shape) for key, _, shape, _ in tensors}
    if not keys:
        raise _shardcast.Unsupported("no tensors in its header")
    if bad := next((key for key, dt, shape, _ in tensors if dt not in _FLOATING or not shape), None):
        raise _shardcast.Unsupported(f"'{bad}' is not a floating tensor of one dim or more")
    rules = conversion_rules(_WithConfig(config))
    merges = expert_merges(rules)
    if _renamed_keys(rules, keys) or len([r for r in rules if type(r).__name__ == "WeightConverter"]) != len(merges):
        raise _shardcast.Unsupported(f"transformers converts {config.model_type}'s keys beyond stacking experts")
    fused, parts = _fused(merges, keys)
    out = {}
    for key, (shape, compose) in fused.items():
        out[key] = Planned(key, shape, dtype, compose, rank, world, device)
    for key, shape in keys.items():
        if key not in parts:
            out[key] = Planned(key, shape, dtype, None, rank, world, device)
    if device.type == "cuda":
        # The zeros were written on this thread's current stream (the caller's, maybe not the default one);
        # the stream's copies run on its own thread's default stream, which must not overtake them.
        torch.cuda.current_stream(device).synchronize()
    return out


class _WithConfig:
    """What conversion_rules reads of a model: its config, and its class's name (the config's first
    architecture, the class AutoModelForCausalLM builds of a checkpoint it names)."""

    def __init__(self, config):
        self.config = config
        architectures = getattr(config, "architectures", None) or [None]
        self.class_name = architectures[0] or "_WithConfig"


def _fused(merges, keys: Dict[str, Tuple[int, ...]]):
    """({fused key: (shape, per-expert keys in order)}, every per-expert key used): transformers'
    MergeModulelist on dim 0 (stacking the experts), then Concatenate on dim 1 where the rule has it,
    applied to the checkpoint's keys, in the order compositions() gives the C++ load (expert-major)."""
    fused, parts = {}, set()
    for rule in merges:
        sources, target = list(rule.source_patterns), rule.target_patterns[0]
        found: Dict[str, Dict[int, Dict[str, str]]] = {}
        patterns = [(src, re.compile("^(.*)" + re.escape(src).replace(r"\*", r"(\d+)") + "$")) for src in sources]
        for key in keys:
            for src, pattern in patterns:
                if m := pattern.match(key):
                    found.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[src] = key
        for prefix, experts in found.items():
            order = [experts.get(e, {}).get(src) for e in range(len(experts)) for src in sources]
            if None in order:
                raise _shardcast.Unsupported(f"the experts under '{prefix}' are not numbered 0..{len(experts) - 1} "
                                             f"with every one of {sources}")
            first = [keys[experts[0][src]] for src in sources]
            if any(keys[k] != first[i % len(sources)] for i, k in enumerate(order)) or \
                    any(len(s) != 2 or s[1] != first[0][1] for s in first):
                raise _shardcast.Unsupported(f"the experts under '{prefix}' differ in shape")
            rows = sum(s[0] for s in first)
            fused[prefix + target] = ((len(experts), rows, first[0][1]), order)
            parts.update(order)
    return fused, parts


class Stream:
    """The stream of one from_pretrained on its thread, and what the main thread checks and adopts.

    REQUIRES: started after every rank agreed to stream (`_stream_rules.agree`); `finish` called on every rank."""

    def __init__(self, planned: Dict[str, Planned], path: str, options: Dict[str, str], timeout_s: float,
                 pg, store, rank: int, world: int):
        from ._group import _store_host, operation_store
        self.planned, self.rank, self.world, self.timeout_s = planned, rank, world, timeout_s
        self.pg, self.store = pg, store
        self.report, self.error, self.seconds = None, None, 0.0
        self.moved = time.monotonic()  # when the stream last reported bytes landed (its progress)
        op_store = operation_store(pg, store)  # made here, in step on every rank, before the thread
        host = _store_host(store) if store is not None else ""
        entries = [p.entry() for p in planned.values()]
        self.thread = threading.Thread(target=self._run, name="shardcast-stream", daemon=True,
                                       args=(entries, path, options, op_store, host))
        try:
            self.thread.start()
        except Exception as e:  # noqa: BLE001 -- a thread it cannot start ("can't start new thread")
            self._carry(e, options, op_store, host)

    def _carry(self, e: BaseException, options: Dict[str, str], op_store, host: str) -> None:
        """This rank's share of the stream's handshake, with its failure: the other ranks' streams, already in
        it, end at once with the verdict naming this rank (not at their timeout), which `finish` then
        raises on every rank."""
        from ._carried import _agreed, _problem
        problem = _problem(e)
        self.error = e
        try:
            _agreed(problem, lambda: _shardcast.load_entries([], [], "", options, {}, op_store, self.rank,
                                                             self.world, None, problem, host))
        except BaseException as verdict:  # noqa: BLE001 -- the others' verdict: finish raises it everywhere
            self.error = verdict

    def _run(self, entries, path, options, op_store, host) -> None:
        start = time.monotonic()
        try:
            self.report = _shardcast.load_entries(entries, [], path, options, {}, op_store, self.rank, self.world,
                                                  self._progress, None, host)
        except BaseException as e:  # noqa: BLE001 -- handed to the main thread, which agrees on it
            self.error = e
        finally:
            del entries  # the error's traceback holds this frame: it must not keep the rank's buffers alive
        self.seconds = time.monotonic() - start

    def _progress(self, done: int, total: int) -> None:
        self.moved = time.monotonic()

    def _join(self) -> Optional[BaseException]:
        """Waits for the stream while it moves: a CommTimeout once it has neither ended nor landed bytes for
        the load's timeout (a long load is not a stuck one; the C++ load's own waits have that deadline too)."""
        waited = time.monotonic()
        while self.thread.is_alive():
            self.thread.join(1.0)
            if time.monotonic() - max(self.moved, waited) > self.timeout_s:
                return _shardcast.CommTimeout(f"the stream beside the build landed nothing for {self.timeout_s:g} s "
                                              f"and did not end")
        return self.error

    def finish(self, model, problem: Optional[BaseException]) -> Tuple[dict, List[str], List[str]]:
        """(the stream's report, the model's persistent buffers, the parameters to load after all), once
        every rank's model matched the plan and the stream succeeded everywhere; the buffers of the other
        parameters are then their sharded data. The parameters to load after all are those the model
        class keeps in another dtype (transformers' `_keep_in_fp32_modules[_strict]`: routers, sinks),
        which the header cannot tell. Otherwise every rank raises the first rank's problem (this rank's
        `problem` from its build or layout, a model that differs from the plan, the stream's own error,
        a stream that stopped moving), naming that rank."""
        value = None
        if problem is None:
            problem, redo = _mismatch(model, self.planned, self.rank, self.world)
            value = [sorted(_persistent_buffers(model)), redo]
        stream_problem = self._join()
        problem = problem or stream_problem
        try:
            persistent, redo = _agree_or_raise(self.pg, self.store, self.rank, self.world, problem, value,
                                               self.timeout_s)
        except BaseException:
            self.planned = {}  # the rank's share of the model (on a GPU, too): not held by the raised error's frames
            raise
        if redo:
            logger.debug("from_pretrained loads %d parameter(s) after the build (kept in a dtype of their own, or "
                         "under a name the header does not hold): %s", len(redo),
                         ", ".join(redo[:4]) + (", ..." if len(redo) > 4 else ""))
        adopt(model, self.planned, redo=frozenset(redo))
        return self.report, persistent, redo


def _persistent_buffers(model) -> List[str]:
    from ._names import named_buffers
    from ._prepare import _non_persistent
    non_persistent = {n for n, *_ in _non_persistent(model)}
    return [n for n, _ in named_buffers(model) if n not in non_persistent]


def _agree_or_raise(pg, store, rank: int, world: int, problem: Optional[BaseException], value: Any,
                    timeout_s: float) -> Any:
    """Rank 0's `value` (JSON), when no rank has a problem and every rank's value is the same. Otherwise the
    first problem in rank order, else the first value that differs from rank 0's, raised on every rank naming its
    rank (its own class; on the rank where it arose, chained to it). Rank 0 decides (`_decided.decided`):
    every rank reads one answer, not every rank's value."""
    from ._decided import decided
    from ._exchange import channel
    from ._carried import _problem
    mine = [None if problem is None else list(_problem(problem))[:2], value]  # (kind, message)
    verdict, _ = decided(channel(pg, store), rank, world, mine, _first_problem, timeout_s, "every rank's verdict")
    if verdict[0] == "ok":
        return verdict[1]
    _, r, kind, message = verdict
    error = getattr(_shardcast, kind, _shardcast.InternalError)
    if not (isinstance(error, type) and issubclass(error, _shardcast.ShardcastError)):
        error = _shardcast.InternalError
    raise error(f"rank {r}: {message}") from (problem if r == rank else None)


def _first_problem(every: List[Any]) -> Dict[str, Any]:
    """`_agree_or_raise`'s verdict from every rank's [problem, value]: ["ok", rank 0's value], or ["failed",
    rank, kind, message] for the first rank in rank order with a problem, else with a value other than rank
    0's (a problem says more than the values it left different)."""
    first = next(((r, p) for r, (p, _) in enumerate(every) if p is not None), None)
    if first is None:
        other = next((r for r, (_, v) in enumerate(every) if v != every[0][1]), None)
        if other is None:
            return {"": ["ok", every[0][1]]}
        first = (other, ["ManifestMismatch", f"its built model has [persistent buffers, parameters in a dtype of "
                                             f"their own] {every[other][1]}, rank 0's {every[0][1]}"])
    r, (kind, message) = first
    return {"": ["failed", r, kind, message]}


def _mismatch(model, planned: Dict[str, Planned], rank: int, world: int) -> Tuple[Optional[BaseException], List[str]]:
    """(a ManifestMismatch naming the first parameter of the built model that the plan foresaw with another
    shape or placement, else None; the parameters to load after the build: those the plan did not foresee,
    and those as planned but for their dtype)."""
    from torch.distributed.tensor import DTensor, Shard
    from ._materialize import _fsdp_params, _padded_shape
    from ._layouts import world_layout
    from ._names import named_parameters
    fsdp = _fsdp_params(model)
    redo = []
    meshes: dict = {}  # for world_layout: each mesh worked out once over this check

    def over_world(mesh) -> bool:  # a 1-D mesh of its own (not a slice) over the world in rank order
        shape, ranks, sliced = world_layout(mesh, meshes)
        return len(shape) == 1 and not sliced and ranks == list(range(world))

    for name, p in named_parameters(model):
        want = planned.get(name)
        what = None
        if want is None:  # under a name the header does not hold (a tied lm_head transformers' FSDP unties):
            redo.append(name)  # the load after the build resolves it as the sequential load would
        elif not isinstance(p, DTensor) or tuple(p.placements) != (Shard(0),) or not over_world(p.device_mesh):
            what = f"is laid out as {getattr(p, 'placements', 'a plain tensor')}, not Shard(0) over the {world} ranks"
        elif p.device_mesh.device_type != want.padded.device.type:
            what = f"is on a {p.device_mesh.device_type} mesh, the plan's buffers on {want.padded.device.type}"
        elif tuple(p.shape) != want.shape:
            what = f"is {p.dtype} {list(p.shape)}, the plan {want.dtype} {list(want.shape)}"
        elif tuple(p.to_local().shape) != tuple(want.local.shape) or \
                _padded_shape(fsdp.get(id(p)), tuple(p.to_local().shape)) != tuple(want.padded.shape):
            what = f"holds {list(p.to_local().shape)} on rank {rank}, the plan {list(want.local.shape)} " \
                   f"in a padded {list(want.padded.shape)}"
        elif p.dtype != want.dtype:
            redo.append(name)  # kept in its own dtype by the model class: loaded after the build
        if what is not None:
            return _shardcast.ManifestMismatch(f"parameter '{name}' of the built model {what}: its layout differs "
                                               f"from the one the stream predicted"), []
    return None, redo


def adopt(model, planned: Dict[str, Planned], redo: frozenset = frozenset()) -> None:
    """The planned buffers become the parameters' sharded data (no copy); those to load after all (`redo`)
    get fresh zeros instead, on the planned buffers' device, so that no parameter is left on meta for the
    load after."""
    from ._materialize import adopt_storage
    from ._names import named_parameters
    device = next(iter(planned.values())).padded.device if planned else torch.device("cpu")
    adopt_storage(model, {id(p): None if name in redo else planned[name].padded for name, p in named_parameters(model)},
                  device)
