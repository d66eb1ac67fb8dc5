"""`shardcast.from_pretrained`: the common case in one call.

    model = shardcast.from_pretrained("org/name" or "/path/to/checkpoint", mesh=mesh)

is, on every rank,

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    shardcast.prepare(model, config=config)
    for layer in <every module whose class is in model._no_split_modules>:   # the decoder layers
        fully_shard(layer, mesh=mesh, **fsdp_kwargs)
    fully_shard(model, mesh=mesh, **fsdp_kwargs)
    model.shardcast_report = shardcast.load(model, path, source=source, target=target)

With `distributed_config=DistributedConfig(tp_size=..., fsdp_size=..., ep_size=..., dp_replicate_size=...)`
(or those sizes as keywords), the model is laid out by transformers' own plans instead, exactly as
transformers' `from_pretrained(distributed_config=...)` lays it out (its `tp_plan`, `ep_plan` and
`fsdp_plan`, on its own meshes), and then loaded by shardcast: a script moving from transformers'
native loading changes one word.

Under that default layout (a 1-d mesh of the whole world, on the host or on the GPUs), and under
transformers' FSDP alone (distributed_config with fsdp_size = the world size and every other size 1, which
lays every parameter out the same way), the load does not wait for the model: each rank's pieces follow from the checkpoint's
header, so they stream into their final buffers on a thread of their own while the model is imported,
built and sharded, and become FSDP2's sharded data with no copy; the built model is checked against that
plan first (_stream.py). Any other layout loads after fully_shard, as above (said at DEBUG level on the
"shardcast" logger).

A repo id is looked up in the local Hugging Face cache only (HF_HUB_CACHE / HF_HOME); nothing is
downloaded, so every rank resolves the same snapshot without touching the network.
"""
from __future__ import annotations

import functools
import gc
import os
from typing import Any, Dict, Optional, Sequence, Union

import torch

from . import _prefetch, _stream, _stream_rules
from ._load import _target
from ._log import logged
from ._meta_model import _build_meta, _import_modeling, _quantized_layout
from ._phases import PhaseClock, with_phases
from ._shardcast import CheckpointError, InvalidArgument
# The ranks and their layout (_world.py); shard_units is public here, _fully_shard and _pretrained_target
# are taken from here by tests.
from ._world import (_default_mesh, _dist_ready, _distributed_config, _fully_shard, _load_keywords,  # noqa: F401
                     _model_dtype, _parallelize, _pretrained_target, shard_units)

__all__ = ["from_pretrained", "resolve_checkpoint", "shard_units"]


def resolve_checkpoint(path_or_repo_id: Union[str, os.PathLike], revision: Optional[str] = None) -> str:
    """A checkpoint directory: the path itself, or a repo id's snapshot in the local Hugging Face cache.

    Raises CheckpointError naming the cache it looked in when a repo id is not there (no download is
    attempted), InvalidArgument for a path that is a file.
    """
    name = os.fspath(path_or_repo_id)
    if os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise CheckpointError(f"'{name}' holds no config.json: from_pretrained builds the model its config "
                                  "describes (shardcast.load takes a model you built, with a checkpoint of weights "
                                  "alone)")
        return name
    if os.path.exists(name):
        raise InvalidArgument(f"'{name}' is a file: pass the checkpoint's directory (config.json and *.safetensors)")
    if name.startswith(("/", "./", "../", "~")) or name.count("/") > 1:  # a path, never a repo id ("org/name")
        raise CheckpointError(f"'{name}': no such directory (a checkpoint directory holds config.json and "
                              "*.safetensors)")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub import constants
    except ImportError as e:
        raise CheckpointError(f"'{name}' is not a directory, and huggingface_hub, which resolves repo ids from "
                              f"the local cache, is not installed: {e}") from None
    try:
        return snapshot_download(name, revision=revision, local_files_only=True)
    except Exception as e:  # invalid id, not cached, revision not cached: all the same to the caller
        cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"'{name}' is neither a checkpoint directory nor a model in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}); shardcast does not download: fetch it first "
            f"(`hf download {name}`) or pass a directory. ({type(e).__name__}: {cause})") from None


def _join_failed_load(error: Exception, target: Optional[str], mesh, dc, meshes_made: bool,
                      load_kwargs: Dict[str, Any]) -> None:
    """This rank failed before its load: it makes what the others make before theirs (the default group,
    then the mesh or transformers' meshes, whose groups every rank must join), then enters the load's
    agreement with its problem, whose verdict raises it on every rank, naming this rank, with the call's
    timeout= (load_kwargs) as the others have it. Never returns.

    Where this rank cannot know which groups the others make (distributed_config given, but this rank
    failed before it was read), the others wait for it in transformers' group creation until the
    process group's timeout."""
    from ._group import _group
    from ._carried import _problem
    from ._load import _fail_load
    problem = _problem(error)
    if target not in (None, "cpu", "pinned", "cuda"):
        target = None
    try:
        _dist_ready("cuda" if target == "cuda" else "cpu")
    except Exception:  # noqa: BLE001 -- without the default group there is no one to tell: this rank's own error
        raise error from None
    if not meshes_made:
        try:
            if dc is not None:
                from transformers import PreTrainedModel
                PreTrainedModel.prepare_distribute_model(dc, device_map=None)
            elif mesh is None:
                _default_mesh(target)
        except Exception:  # noqa: BLE001 -- the load's agreement reports this rank's first failure
            pass
    pg, rank, world, store = _group(load_kwargs.get("process_group"))
    _fail_load(pg, rank, world, store, problem, mapping=False, timeout=load_kwargs.get("timeout"))


def _with_every_phase(report, clock: PhaseClock, load_kwargs: Dict[str, Any]):
    """The load's report with every rank's phases (exchanged through the load's group, with its timeout)."""
    from ._exchange import channel, gathered
    from ._group import _group
    from ._load import _options, _timeout_ms
    from ._shardcast import load_timeout_seconds
    pg, rank, world, store = _group(load_kwargs.get("process_group"))
    timeout_s = load_timeout_seconds(_options(timeout_ms=_timeout_ms(load_kwargs.get("timeout"))))
    mine = {"phases": clock.seconds, "seconds": clock.total(), "cpu_seconds": clock.cpu()}
    try:
        every = gathered(channel(pg, store), rank, world, mine, timeout_s, "every rank's phase times")
    except Exception as e:  # noqa: BLE001 -- the model is loaded on every rank: only the figures are missing
        # (gathered's one outcome: every rank comes here, or none; a stalled store only on the ranks it stalled)
        _stream_rules.logger.warning("from_pretrained: every rank's phase times did not arrive (%s); the report "
                                     "holds this rank's alone", e)
        every = [mine if r == rank else {"phases": {}, "seconds": 0.0, "cpu_seconds": 0.0} for r in range(world)]
    return with_phases(report, every)


def _agree_first(failed: Optional[BaseException], why: Optional[str], mesh, target, dc, beside: Optional[bool],
                 load_kwargs: Dict[str, Any]):
    """((pg, rank, world, store, timeout_s), the first exchange's Verdict, this rank's failure so far), or
    (None, None, failure) where this rank has no group to agree in. Every rank comes here, whatever its
    reasons not to stream, a failed one too (it says so, with its problem, and every rank then raises the
    failed ranks' problems at once: Verdict.failed): so the node's CPUs are agreed for the read-ahead as
    well, and a reason that differs between ranks (a keyword, a variable) is agreed, never a rank leaving
    alone.
    why: the call's reason not to stream (its arguments), or None. beside: this rank's
    SHARDCAST_STREAM_BESIDE_BUILD (or the keyword), None to go by its node's CPUs."""
    from ._group import _group
    from ._load import _options, _timeout_ms
    from ._shardcast import load_timeout_seconds
    try:
        _dist_ready("cuda" if target == "cuda" else "cpu")
        pg, rank, world, store = _group(load_kwargs.get("process_group"))
    except Exception as e:  # noqa: BLE001 -- no group to agree in: _join_failed_load raises it on this rank
        return None, None, failed or e
    timeout_s = 600.0
    if failed is not None:
        why = f"it failed already ({type(failed).__name__})"
    try:
        timeout_s = load_timeout_seconds(_options(timeout_ms=_timeout_ms(load_kwargs.get("timeout"))))
        why = why or _stream_rules.off_layout(mesh, target, world, dc)
        if why is None and beside is False:
            why = f"{_stream_rules.BESIDE_VAR}=0"
    except Exception as e:  # noqa: BLE001 -- this rank cannot stream: every rank then loads after the build
        why = why or f"{type(e).__name__}: {e}"
    from ._carried import _problem
    verdict = _stream_rules.agree(pg, store, rank, world, why, timeout_s, by_cores=beside is None,
                                  failed=tuple(_problem(failed)[:2]) if failed is not None else None)
    return (pg, rank, world, store, timeout_s), verdict, failed


def _start_stream(group, path, config, dtype, target, source, load_kwargs: Dict[str, Any]):
    """The stream beside the build, or None: where every rank may stream (the first exchange said so), each
    plans its part from the header, and all stream or none does (a second exchange: the header's rules and
    the buffers cost ~1 s a rank on 2 cores, so no rank plans where the first said no)."""
    from ._load import _options, _timeout_ms
    pg, rank, world, store, timeout_s = group
    planned, options, why = None, None, None
    try:
        options = _options(source=source, target=target, verify=load_kwargs.get("verify"),
                           chunk_bytes=load_kwargs.get("chunk_bytes"), readahead_bytes=load_kwargs.get("readahead_bytes"),
                           read_threads=load_kwargs.get("read_threads"), staging_slots=load_kwargs.get("staging_slots"),
                           timeout_ms=_timeout_ms(load_kwargs.get("timeout")))
        planned = _stream.plan(path, config, dtype, rank, world, _stream.device_of(target))
    except Exception as e:  # noqa: BLE001 -- this rank cannot stream: every rank then loads after the build
        why = f"{type(e).__name__}: {e}"
    if not _stream_rules.agree(pg, store, rank, world, why, timeout_s).stream:
        return None
    return _stream.Stream(planned, path, options, timeout_s, pg, store, rank, world)


def _finish_stream(stream, model, failed, path, source, target, config, load_kwargs, clock: PhaseClock):
    """The stream's report once every rank's model matched its plan (else the same error on every rank),
    the buffers filled by a load of their own after it; `wait` is what this rank spent here."""
    from ._load import STREAMED, load
    from ._report import LoadReport
    report, persistent, redo = stream.finish(model, failed)
    clock.charge("stream", stream.seconds)
    report = logged("load", path, None, LoadReport.from_dict({**report, "stream_beside_build": True}))
    if persistent or redo:  # from the checkpoint, by a load of their own; non-persistent ones are prepare's
        rest = {k: v for k, v in load_kwargs.items() if k not in ("strict", "strict_keys")}
        object.__setattr__(model, STREAMED, frozenset(stream.planned) - set(redo))
        try:
            load(model, path, source=source, target=target, config=config, strict=False, **rest)
        finally:
            object.__delattr__(model, STREAMED)
    clock.lap("wait")
    return report


def _without_cyclic_gc(fn):
    """fn with Python's cyclic garbage collector paused for the call, as it was after (`gc.disable`, and
    `gc.enable` only where it was enabled). from_pretrained's imports (transformers, the modeling module)
    and its meta model make about a million long-lived objects, and each full collection on the way walks
    all of them: measured in one process on the 2-core VM (40-layer Qwen3-MoE: transformers' imports, the
    config, the meta model), 2.33-2.74 s of CPU with the collector against 1.90-1.98 s without, per rank.
    Nothing of the call is cyclic garbage worth collecting early: its tensors are freed by reference count.
    The objects it made are still young when the collector resumes, so the caller's first collections
    after it walk them once (bench_peers times one full collection after the call: `gc_after_seconds`);
    the repeated full walks during the call are what is saved. Process-wide, as gc.disable is: the
    caller's other threads run without the collector for the call too."""
    @functools.wraps(fn)
    def paused(*args, **kwargs):
        was = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was:
                gc.enable()
    return paused


@_without_cyclic_gc
def from_pretrained(path_or_local_repo_id: Union[str, os.PathLike], *, mesh=None,
                    dtype: Union[torch.dtype, str, None] = torch.bfloat16, shard: Sequence[str] = ("layers",),
                    fsdp_kwargs: Optional[Dict[str, Any]] = None, source: Optional[str] = None,
                    target: Optional[str] = None, distributed_config=None, tp_size: Optional[int] = None,
                    ep_size: Optional[int] = None, fsdp_size: Optional[int] = None,
                    dp_replicate_size: Optional[int] = None, revision: Optional[str] = None,
                    trust_remote_code: bool = False, prefetch: Optional[bool] = None, keep_quantized: bool = False,
                    buffer_init: Optional[Dict[str, Any]] = None, model_cls=None,
                    stream_beside_build: Optional[bool] = None, **load_kwargs) -> torch.nn.Module:
    """An FSDP2 model with its checkpoint loaded, each rank holding only its own rows.

    Every rank calls it together (under torchrun; a single process with no launcher is a world of one).
    Every argument after the path is keyword-only.

    path_or_local_repo_id: a checkpoint directory (config.json + safetensors), or a repo id already in
        the local Hugging Face cache (never downloaded).
    mesh: a DeviceMesh: 1-d (FSDP over its ranks), or 2-d (replicate, shard) for HSDP, as fully_shard takes
        it; default: all ranks, on CUDA when the job runs on GPUs (torch.cuda.is_available() and a GPU for
        LOCAL_RANK, as transformers' distributed_config decides), else on CPU.
    target: where the shards live; default: the mesh's device (cuda:LOCAL_RANK for a CUDA mesh, bound
        as this rank's current device). "cpu" or "pinned" into a CUDA mesh is an InvalidArgument.
    distributed_config: transformers' DistributedConfig (or a dict of it), or its sizes as keywords
        (tp_size, ep_size, fsdp_size, dp_replicate_size): the model is laid out with transformers' own
        TP, EP and FSDP2 plans and meshes instead of `mesh`/`shard`/`fsdp_kwargs`, then loaded.
    dtype: the model's parameter dtype; checkpoint tensors are converted while streamed (fp8, MXFP4 and
        NVFP4 weights dequantized with their scales). "auto", as transformers reads it: the config's dtype,
        else the checkpoint's first floating tensor's; None: the model class's own.
    keep_quantized: for an fp8 checkpoint (DeepSeek-V3, MiniMax-M2, FineGrainedFP8) or an MXFP4 one
        (gpt-oss), build transformers' quantized layout instead (FP8Linear/FP8Experts: fp8 weights and
        their `*_scale_inv` block scales, experts fused; Mxfp4GptOssExperts: the packed uint8 blocks,
        with their uint8 E8M0 `*_scales` as parameters beside them) and load the checkpoint's bytes
        unchanged; `dtype` is then the other modules'. FSDP2 shards each weight and its scales by their
        own rows (MXFP4: both over experts); the all-gather before use pairs them whole again.
    model_cls: what to build (default AutoModelForCausalLM): any AutoModel* class, a transformers model
        class (LlamaForCausalLM), or a callable(config) returning a module (built under
        torch.device("meta"); its floating tensors are cast to `dtype`). Its parameter names must be the
        checkpoint's keys (AutoModel on a *ForCausalLM checkpoint, whose keys carry "model.", does not pair).
    buffer_init: values for non-persistent buffers no built-in rule covers (RoPE, per attention type
        too, and Gemma's embed_scale have rules), as for shardcast.prepare: {fnmatch pattern: callable(name, meta)}.
    shard: which submodules get their own fully_shard before the root's (see `shard_units`).
    fsdp_kwargs: passed to every fully_shard (mp_policy, reshard_after_forward, offload_policy, ...).
    source, target, **load_kwargs: passed to shardcast.load (verify, chunk_bytes, timeout, strict);
        source None: SHARDCAST_SOURCE, else the default.
    prefetch: on one node, have the kernel read the files (each local rank its 1/L, at most half of
        MemAvailable) while the model is built and sharded, so a cold load starts warm (`_prefetch.py`).
        None (default): where the node has at least two CPUs a rank (its ranks' affinity masks together, as
        for stream_beside_build); True: always (on one node); False: never.
    stream_beside_build: stream the checkpoint into each rank's buffers while the model is built and laid
        out, where the layout follows from the config and the header (the default FSDP layout, or
        distributed_config with FSDP alone; `shardcast/_stream.py`). True: wherever it does; False: build,
        lay out, then load. None (default): SHARDCAST_STREAM_BESIDE_BUILD (1 or 0) where it is set, else
        where the CPUs its ranks on a node may run on (their affinity masks together, or fewer where their
        cgroups' CPU quotas together allow fewer: a pod's CPU limit) are at least two per rank (the stream
        keeps one busy, the build another; with fewer the overlap was slower than loading after the build:
        bench/RESULTS.md).

    Returns the FSDP2 model; `model.shardcast_report` is the load's report, with each rank's set-up by phase
    (`report.ranks[r].phases`: import, config, build, layout, stream, wait; `pretrained_cpu_seconds`: the
    CPU time of the rank's process over the call; `stream_beside_build` says whether the stream
    overlapped build and layout). Raises a ShardcastError
    subclass, the same on every rank: a failure on one rank before its load (a bad SHARDCAST_TARGET, a
    config it cannot read) is carried into the load's agreement, so every rank raises it at once.
    """
    clock = PhaseClock()
    from transformers import AutoConfig
    from . import load, prepare
    clock.lap("import")

    ahead, dc, meshes_made, stream, model = None, None, False, None, None
    sizes = {"tp_size": tp_size, "ep_size": ep_size, "fsdp_size": fsdp_size, "dp_replicate_size": dp_replicate_size}
    try:
        # From the first line to the load's agreement, a failure on this rank is carried into it
        # (_join_failed_load, or the stream's agreement): the others would otherwise wait for this rank
        # until their timeout.
        failed, beside = None, None
        try:
            # First, from the arguments alone: every rank reads it or none does, and the call's reason not to
            # stream (_stream_rules.unpredictable) depends on it, never on a failure of its own after.
            dc = _distributed_config(distributed_config, sizes)
            if dc is not None and mesh is not None:
                raise InvalidArgument("pass either mesh or distributed_config: transformers' plans make their own "
                                      "meshes")
            target = _pretrained_target(_target(target), mesh)
            _load_keywords(load_kwargs)
            path = resolve_checkpoint(path_or_local_repo_id, revision=revision)
            beside = _stream_rules.beside_wanted(stream_beside_build)
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
            dtype = _model_dtype(dtype, config, path)
        except Exception as e:  # noqa: BLE001 -- carried into the agreement below
            failed = e
        dc_given = distributed_config is not None or any(v is not None for v in sizes.values())
        try:
            why = "stream_beside_build=False" if stream_beside_build is False else _stream_rules.unpredictable(
                mesh, dc_given, dc, keep_quantized, model_cls, shard, fsdp_kwargs, dtype, load_kwargs)
        except Exception as e:  # noqa: BLE001 -- an argument it cannot read: no stream, and the failure is agreed
            why = f"{type(e).__name__}: {e}"
            failed = failed or e
        group, verdict, failed = _agree_first(failed, why, mesh, target, dc, beside, load_kwargs)
        if verdict is not None and verdict.failed:  # every rank at once: no model built for nothing
            _stream_rules.raise_failed(verdict, group[2], failed)
        if failed is None and _prefetch.wanted(prefetch, verdict):
            try:  # only a speed-up: a rank that cannot start it goes on without, with the others
                ahead = _prefetch.start(path, verdict.local_rank, verdict.local_world)
            except Exception as e:  # noqa: BLE001
                _stream_rules.logger.debug("from_pretrained reads no checkpoint ahead on this rank: %s", e)
        if failed is None and verdict.stream:
            stream = _start_stream(group, path, config, dtype, target, source, load_kwargs)
        clock.lap("config")
        try:
            if failed is not None:
                raise failed
            _import_modeling(config, model_cls)
            clock.lap("import")
            model = _build_meta(config, dtype, trust_remote_code, model_cls, untied=dc is not None)
            if keep_quantized:
                _quantized_layout(model, config, path, dtype)
            prepare(model, config=config, target=target or "cpu", buffer_init=buffer_init)
            clock.lap("build")
            if dc is not None:
                _dist_ready("cuda" if target == "cuda" else "cpu")
                meshes_made = True  # from here on, whatever groups transformers makes were made
                model = _parallelize(model, config, dc, trust_remote_code)
            else:
                if mesh is None:
                    mesh = _default_mesh(target)
                meshes_made = True
                fully_shard = _fully_shard()
                kwargs = dict(fsdp_kwargs or {})
                for unit in shard_units(model, shard):
                    fully_shard(unit, mesh=mesh, **kwargs)
                fully_shard(model, mesh=mesh, **kwargs)
            clock.lap("layout")
        except Exception as e:  # noqa: BLE001 -- any failure here must reach every rank, not only this one
            if stream is None:
                _join_failed_load(e, target, mesh, dc, meshes_made, load_kwargs)
            failed = e
        if stream is not None:
            report = _finish_stream(stream, model, failed, path, source, target, config, load_kwargs, clock)
        else:
            report = load(model, path, source=source, target=target, config=config, **load_kwargs)
            report = type(report).from_dict({**report, "stream_beside_build": False})  # a key either way
            clock.lap("stream")
        if dc is not None and hasattr(model, "tie_weights"):
            # transformers' FSDP layout unties tied weights; its from_pretrained ties them again after the load
            model.tie_weights(recompute_mapping=False)
        model.shardcast_report = _with_every_phase(report, clock, load_kwargs)
        if not keep_quantized and hasattr(model.config, "quantization_config"):
            del model.config.quantization_config  # dequantized, as transformers drops it after dequantizing
        logged("from_pretrained", f"{path} ({type(model).__name__})", None, model.shardcast_report)
        model.eval()  # as transformers' from_pretrained returns it: dropout and MoE routing noise off
        return model
    finally:
        if ahead is not None:
            ahead.stop()
