"""Where from_pretrained's ranks and their layout come from: the default process group (from torchrun's or
srun's variables, or a world of one), the target device and this rank's GPU, the default mesh, the modules
that get their own fully_shard, and transformers' DistributedConfig and plans.
"""
from __future__ import annotations

import datetime
import fnmatch
import math
import os
from typing import Dict, List, Optional, Sequence

import torch

from ._launch import launch
from ._load import _cuda_device
from ._shardcast import InvalidArgument


def _dist_ready(device_type: str) -> None:
    """Initializes the default process group from torchrun's or srun's variables, or, for a process no
    launcher started, as a world of one. A launcher's world of several with no rendezvous address is an
    InvalidArgument: never a world of one per process, each loading the whole model."""
    import torch.distributed as dist
    if dist.is_initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
    timeout = datetime.timedelta(minutes=10)
    where = launch()
    if where.world > 1:
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            ask = ("MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1) and MASTER_PORT="
                   "a free port" if where.launcher == "slurm" else "MASTER_ADDR and MASTER_PORT (torchrun sets both)")
            raise InvalidArgument(
                f"rank {where.rank} of {where.world} ({where.launcher}'s variables), and no {' or '.join(missing)}: "
                f"export {ask}, or call torch.distributed.init_process_group before shardcast")
    if where.launcher == "torchrun" and "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, timeout=timeout)  # env://: torchrun's own store where it has one
        return
    if where.launcher == "slurm" and where.world > 1:
        dist.init_process_group(backend, init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                                rank=where.rank, world_size=where.world, timeout=timeout)
        return
    # A single process with no launcher: a world of one over a loopback store.
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=timeout)


def _pretrained_target(target: Optional[str], mesh) -> Optional[str]:
    """from_pretrained's target: the one given, else the mesh's device, else CUDA where the job runs on GPUs.
    A CUDA target binds this rank to cuda:LOCAL_RANK, as transformers' distributed_config does."""
    if target is None:
        on_gpus = mesh.device_type == "cuda" if mesh is not None else _job_has_gpus()
        target = "cuda" if on_gpus else None
    if target == "cuda":
        if not torch.cuda.is_available():
            raise InvalidArgument(f"target='cuda' (target= or SHARDCAST_TARGET), and torch sees no GPU on this rank "
                                  f"(torch {torch.__version__}, CUDA {torch.version.cuda}): leave target unset or "
                                  f"pass target='cpu'")
        torch.cuda.set_device(_cuda_device())
    return target


def _job_has_gpus() -> bool:
    """torch sees a GPU for this rank's LOCAL_RANK (0 without a launcher)."""
    if not torch.cuda.is_available():
        return False
    local = os.environ.get("LOCAL_RANK", "0").strip()
    return int(local) < torch.cuda.device_count() if local.isdigit() else True


def _default_mesh(target: Optional[str]):
    from torch.distributed.device_mesh import init_device_mesh
    import torch.distributed as dist
    device_type = "cuda" if target == "cuda" else "cpu"
    _dist_ready(device_type)
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard  # public from torch 2.6
    except ImportError:  # torch 2.4 / 2.5
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def shard_units(model: torch.nn.Module, shard: Sequence[str] = ("layers",)) -> List[torch.nn.Module]:
    """The modules `from_pretrained` gives their own `fully_shard`, in module order (the root excluded).

    Each entry of `shard` is "layers" (every module whose class name is in the model's own
    `_no_split_modules`: the decoder layers), a class name, or a pattern over module names
    ("model.embed_tokens", "model.layers.*.mlp").
    """
    if isinstance(shard, str):
        shard = (shard,)
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    units, seen = [], set()
    for name, module in model.named_modules():
        if module is model:
            continue
        cls = type(module).__name__
        for sel in shard:
            # "layers" is the keyword, never a name: a bare AutoModel's own "layers" ModuleList matched it
            # (fully_shard of a ModuleList, which has no forward, failed)
            if (cls in no_split) if sel == "layers" else (sel == cls or fnmatch.fnmatchcase(name, sel)):
                break
        else:
            continue
        # Keep the outermost match: a pattern like "model.layers.*" also matches each layer's children.
        if any(name.startswith(p + ".") for p in seen):
            continue
        seen.add(name)
        units.append(module)
    if "layers" in shard and not units:
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None:
            raise InvalidArgument(f"{type(model).__name__} declares no _no_split_modules and has no model.layers: "
                                  "pass shard=(class names or module-name patterns)")
        units = list(layers)
    return _dtype_units(model, units) + units


def _dtype_units(model: torch.nn.Module, units: List[torch.nn.Module]) -> List[torch.nn.Module]:
    """The modules whose parameters (their own and their children's) are all of another dtype than the
    rest of their unit's (a router gate kept in float32 by `_keep_in_fp32_modules_strict` in a bf16 decoder
    layer): FSDP2 all-gathers one dtype a unit, and a unit of two failed at the first forward ("FSDP expects
    uniform original parameter dtype"). Each gets a fully_shard of its own, before its unit's: the
    outermost such module, never one holding a unit, in module order."""
    modules = dict(model.named_modules())  # parents before children (a shared module once, under its first name)
    unit_ids = {id(u) for u in units}
    unit_names = {name for name, m in modules.items() if id(m) in unit_ids}

    def parent(name: str) -> str:
        return name.rsplit(".", 1)[0] if "." in name else ""

    def above(name: str) -> List[str]:  # the names above `name`, the root's "" included
        parts = name.split(".") if name else []
        return [""] + [".".join(parts[:i]) for i in range(1, len(parts))]

    # One pass each way (18k modules of per-expert lists took 1.5 s with a walk of every subtree): each
    # module's unit (the innermost unit above it, or the root) and its own parameters' dtypes, then each
    # subtree's dtypes, children first.
    owner: Dict[str, str] = {}  # module -> the innermost unit (or the root) whose fully_shard takes its parameters
    count: Dict[str, Dict[torch.dtype, int]] = {}
    subtree: Dict[str, set] = {}
    for name, m in modules.items():
        owner[name] = name if (name in unit_names or not name) else owner[parent(name)]
        subtree[name] = set()
        for p in m._parameters.values():  # parameters(recurse=False), without a generator per module
            if p is None:
                continue
            per = count.setdefault(owner[name], {})
            per[p.dtype] = per.get(p.dtype, 0) + p.numel()
            subtree[name].add(p.dtype)
    for name in reversed(list(modules)):
        if name:
            subtree[parent(name)] |= subtree[name]
    holds_unit = {a for name in unit_names for a in above(name)}
    out, covered = [], set()  # covered: a module taken, and everything under it
    for name, m in modules.items():
        if name and parent(name) in covered:
            covered.add(name)
            continue
        unit = owner[name]
        if name == unit or name in holds_unit:
            continue
        dtypes, per = subtree[name], count.get(unit, {})
        if len(dtypes) == 1 and len(per) > 1 and next(iter(dtypes)) != max(per, key=per.get):
            out.append(m)
            covered.add(name)
    return out



def _model_class(config, trust_remote_code: bool):
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING
    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise InvalidArgument(f"distributed_config: transformers maps no causal LM class to {type(config).__name__}"
                              ) from None


_CHECKPOINT_FLOATS = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _model_dtype(dtype, config, path: str) -> Optional[torch.dtype]:
    """from_pretrained's dtype: a floating torch.dtype, None (the model class's own, as built), or "auto"
    as transformers reads it: the config's dtype (`dtype`, or `torch_dtype` in older configs), else the
    checkpoint's first floating tensor's. Anything else is an InvalidArgument, which from_pretrained
    carries into its first agreement (every rank raises it, none waits)."""
    if isinstance(dtype, str) and dtype == "auto":
        named = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(named, str):
            named = getattr(torch, named, None)
        if isinstance(named, torch.dtype) and named.is_floating_point:
            return named
        from ._shardcast import checkpoint_tensors
        first = next((dt for _, dt, _, _ in checkpoint_tensors(path) if dt in _CHECKPOINT_FLOATS), None)
        if first is None:
            raise InvalidArgument(f"dtype='auto': neither {path}/config.json nor the checkpoint's tensors name a "
                                  "floating dtype; pass one (torch.bfloat16)")
        return _CHECKPOINT_FLOATS[first]
    if dtype is None:
        return None
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgument(f"dtype={dtype!r}: a torch.dtype (torch.bfloat16), 'auto' (the checkpoint's) or None")
    if not dtype.is_floating_point:
        raise InvalidArgument(f"dtype={dtype}: the model's parameters need a floating dtype (torch.bfloat16, "
                              "torch.float32, ...)")
    return dtype


def _load_keywords(load_kwargs: Dict[str, object]) -> None:
    """An InvalidArgument for a keyword shardcast.load does not take, raised before anything is agreed (so
    every rank raises it at once where one rank alone passed it, not a TypeError on that rank after the
    others went on)."""
    import inspect
    from ._load import load
    taken = set(inspect.signature(load).parameters) - {"model", "path", "source", "target", "config", "buffer_init"}
    if unknown := sorted(set(load_kwargs) - taken):
        raise InvalidArgument(f"from_pretrained got unexpected keyword argument(s) {', '.join(unknown)}: it takes "
                              f"its own and shardcast.load's ({', '.join(sorted(taken))})")


def _distributed_config(distributed_config, sizes: Dict[str, Optional[int]]):
    """transformers' DistributedConfig from the argument or the size keywords; None when neither is given."""
    given = {k: v for k, v in sizes.items() if v is not None}
    if distributed_config is None and not given:
        return None
    try:
        from transformers.distributed import DistributedConfig
    except ImportError as e:
        raise InvalidArgument(f"distributed_config needs transformers >= 5 with DistributedConfig: {e}") from None
    if distributed_config is None:
        return DistributedConfig(**given)
    if given:
        raise InvalidArgument(f"pass either distributed_config or {', '.join(sorted(given))}, not both")
    if isinstance(distributed_config, dict):
        return DistributedConfig.from_dict(distributed_config)
    return distributed_config


def _parallelize(model, config, dc, trust_remote_code: bool):
    """Lays out the meta model with transformers' own plans (TP, EP, then FSDP2/HSDP), as its
    from_pretrained(distributed_config=...) does between building the model and loading weights."""
    cls = type(model) if hasattr(type(model), "maybe_distribute_model") else _model_class(config, trust_remote_code)
    import torch.distributed as dist
    # transformers' own check of this raises RuntimeError, which would read as shardcast's InternalError
    sizes = [getattr(dc, n, 1) or 1 for n in ("pp_size", "dp_replicate_size", "fsdp_size", "tp_size")]
    if dist.is_initialized() and sizes != [1, 1, 1, 1] and math.prod(sizes) != dist.get_world_size():
        raise InvalidArgument(f"distributed_config {_sizes(dc)}: its mesh (pp x dp_replicate x fsdp x tp; ep_size "
                              f"splits the fsdp ranks) needs {math.prod(sizes)} processes, but the world has "
                              f"{dist.get_world_size()}")
    try:
        dc, _, mesh_manager = cls.prepare_distribute_model(dc, device_map=None)
        if mesh_manager is None:  # every size 1: nothing to lay out
            return model
        return cls.maybe_distribute_model(model, dc, mesh_manager)
    except ValueError as e:  # transformers' word for a layout its plans cannot make: the caller's sizes
        raise InvalidArgument(f"distributed_config {_sizes(dc)}: {e}") from e


def _sizes(dc) -> str:
    """The sizes a DistributedConfig sets, as text ("tp_size=2, fsdp_size=2")."""
    names = ("tp_size", "ep_size", "fsdp_size", "dp_replicate_size", "pp_size")
    return ", ".join(f"{n}={getattr(dc, n)}" for n in names if getattr(dc, n, None) not in (None, 1)) or "(every size 1)"
