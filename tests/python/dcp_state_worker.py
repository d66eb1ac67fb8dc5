"""One rank of the training-state tests: `python dcp_state_worker.py MODE ROOT OUT` under torchrun's variables.
Each rank writes its results to OUT.<rank> (JSON, rewritten after every scenario).

A tiny model (an embedding, two MLP blocks, a head; dims 37, 26 and 38 divide by neither 3 nor 4) with
AdamW after two real steps, a LambdaLR scheduler, and extra byte items (a dataloader's state: ints,
tuples, int-keyed dicts, bytes, a bf16 tensor) is the state.

save4 (W=4): FSDP over 4 ranks, trained, saved with shardcast's StorageWriter (ROOT/sc) and torch's
             FileSystemWriter (ROOT/fs), and through dcp.async_save on a thread and in a process
             (ROOT/sc-async-thread, ROOT/sc-async-process); then loaded back from both into identical fresh states at FSDP 4,
             HSDP 2x2 and TP x FSDP 2x2 (Colwise/Rowwise on the MLPs); then the failures: a truncated
             rank file, a missing rank file, a missing metadata, a dtype the file does not hold, a
             value that is not plain data, and a disk full on rank 1 while overwriting a checkpoint.
load3 (W=3): the same loads at FSDP 3.

For each load: `mismatch` (keys whose local values differ between the shardcast and the torch round
trip, on this rank) and `full` (every value of the loaded state, DTensors gathered, as CRCs or reprs).
"""
import datetime
import json
import os
import resource
import shutil
import sys
import zlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import shardcast
from shardcast.dcp._state import StorageReader, StorageWriter

VOCAB, HIDDEN, INTER = 37, 26, 38


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.Parameter(torch.ones(HIDDEN))
        self.up = torch.nn.Linear(HIDDEN, INTER)
        self.down = torch.nn.Linear(INTER, HIDDEN, bias=False)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x * self.norm)))


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.layers = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.layers:
            x = b(x)
        return self.head(x)


def build(layout, seed):
    """(model, optimizer, scheduler) sharded as `layout`: fsdp, hsdp (2x2) or tp (2x2: dp x tp)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    torch.manual_seed(seed)
    model = Tiny()
    world = dist.get_world_size()
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
    elif layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        for b in model.layers:
            parallelize_module(b, mesh2["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        mesh = mesh2["dp"]
    for b in model.layers:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: 0.5 ** step)
    return model, optim, sched


def extra_state(seed):
    g = torch.Generator().manual_seed(seed)
    return {"epoch": seed, "position": (seed, 17), "shards": {3: [1.5, None, True], 7: "x" * seed},
            "token": bytes([seed, 0, 255]), "ema": torch.randn(5, 3, generator=g).to(torch.bfloat16)}


def state_of(model, optim, sched, extra):
    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd, "scheduler": sched.state_dict(), "dataloader": extra}


def apply(state, model, optim, sched):
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    sched.load_state_dict(state["scheduler"])


def leaves(obj, path=()):
    if isinstance(obj, dict):
        for k in sorted(obj, key=str):
            yield from leaves(obj[k], path + (str(k),))
    elif isinstance(obj, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in obj):
        for i, x in enumerate(obj):
            yield from leaves(x, path + (str(i),))
    else:
        yield ".".join(path), obj


def crc(t):
    t = t.detach().contiguous().reshape(-1)
    return f"{t.dtype}{list(t.shape)}:{zlib.crc32(t.view(torch.uint8).numpy().tobytes()) if t.numel() else 0}"


def local(v):
    if isinstance(v, DTensor):
        return crc(v.to_local())
    return crc(v) if isinstance(v, torch.Tensor) else repr(v)


def full(v):
    """The global value (DTensors gathered: a collective, made in the same order on every rank)."""
    if isinstance(v, DTensor):
        return crc(v.full_tensor())
    return crc(v) if isinstance(v, torch.Tensor) else repr(v)


def loaded_state(layout, reader, seed=99):
    model, optim, sched = build(layout, seed)
    state = state_of(model, optim, sched, extra_state(0))
    dcp.load(state, storage_reader=reader)
    apply(state, model, optim, sched)
    return state_of(model, optim, sched, state["dataloader"])


def compare_loads(root, layout):
    """Loads ROOT/sc with shardcast and ROOT/fs with torch into identical fresh states."""
    ours = loaded_state(layout, StorageReader(os.path.join(root, "sc")))
    theirs = loaded_state(layout, dcp.FileSystemReader(os.path.join(root, "fs")))
    a, b = dict(leaves(ours)), dict(leaves(theirs))
    mismatch = sorted(k for k in set(a) | set(b) if k not in a or k not in b or local(a[k]) != local(b[k]))
    return {"mismatch": mismatch, "full": {k: full(v) for k, v in a.items()}, "keys": len(a)}


def save(root):
    model, optim, sched = build("fsdp", 1)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(2):
        model(torch.randint(0, VOCAB, (3, 5), generator=g)).float().pow(2).mean().backward()
        optim.step()
        sched.step()
        optim.zero_grad()
    state = state_of(model, optim, sched, extra_state(4))
    dcp.save(state, storage_writer=StorageWriter(os.path.join(root, "sc")))
    dcp.save(state, storage_writer=dcp.FileSystemWriter(os.path.join(root, "fs")))
    # dcp.async_save as torchtitan's async checkpointing calls it (CheckpointManager.dcp_save: a Gloo group of
    # its own): on a thread of the rank's (staged first), and in a process of its own, which receives the
    # writer pickled and makes its own group
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    pg = dist.new_group(backend="gloo")
    for kind in ("thread", "process"):
        dcp.async_save(state, storage_writer=StorageWriter(os.path.join(root, f"sc-async-{kind}")), process_group=pg,
                       async_checkpointer_type=AsyncCheckpointerType[kind.upper()]).result(timeout=120)
    return {"full": {k: full(v) for k, v in leaves(state)}}


def caught(fn):
    """What fn raised on this rank: DCP's CheckpointException carries every failed rank's exception."""
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        fn()
    except (Exception, CheckpointException) as e:  # noqa: BLE001 -- CheckpointException is a BaseException
        failures = getattr(e, "failures", None) or {}
        return {"type": type(e).__name__, "message": str(e)[:4000],
                "failures": {str(r): [type(x[0] if isinstance(x, tuple) else x).__name__,
                                      isinstance(x[0] if isinstance(x, tuple) else x, shardcast.ShardcastError)]
                             for r, x in failures.items()}}
    return {"type": None}


def damaged(root, name, damage):
    """A copy of ROOT/sc named `name`, damaged by rank 0 (damage(dir)); every rank waits for it."""
    path = os.path.join(root, name)
    if dist.get_rank() == 0:
        shutil.copytree(os.path.join(root, "sc"), path)
        damage(path)
    dist.barrier()
    return path


def truncate(path, file, by):
    p = os.path.join(path, file)
    os.truncate(p, os.path.getsize(p) - by)


def retype(path):
    md = os.path.join(path, ".metadata.json")
    doc = json.load(open(md))
    doc["state_dict_metadata"]["model.head.weight"]["properties"]["dtype"] = "int32"  # same itemsize
    json.dump(doc, open(md, "w"))


class Opaque:
    pass


def faults(root):
    res = {}
    for name, damage in (("truncated", lambda p: truncate(p, "__1_0.safetensors", 100)),
                         ("no_rank_file", lambda p: os.unlink(os.path.join(p, "__2_0.safetensors"))),
                         ("no_metadata", lambda p: os.unlink(os.path.join(p, ".metadata.json"))),
                         ("retyped", retype)):
        path = damaged(root, name, damage)
        res[name] = caught(lambda: loaded_state("fsdp", StorageReader(path)))
    # rank 1 given another save's folder (the async save of the same state: other bytes of nothing but
    # its id), and a copy holding one rank file of that save
    other = os.path.join(root, "sc-async-thread")
    path = os.path.join(root, "sc") if dist.get_rank() != 1 else other
    res["other_save"] = caught(lambda: loaded_state("fsdp", StorageReader(path)))
    path = damaged(root, "file_of_other_save", lambda p: shutil.copy(os.path.join(other, "__1_0.safetensors"), p))
    res["file_of_other_save"] = caught(lambda: loaded_state("fsdp", StorageReader(path)))
    model, optim, sched = build("fsdp", 3)
    state = state_of(model, optim, sched, extra_state(2))
    state["dataloader"]["sampler"] = Opaque()
    res["opaque"] = caught(lambda: dcp.save(state, storage_writer=StorageWriter(os.path.join(root, "opaque"))))
    res["opaque_left"] = sorted(os.listdir(os.path.join(root, "opaque")))
    del state["dataloader"]["sampler"]
    # A disk full on rank 1 while overwriting a finished checkpoint: no rank hangs, and the directory no
    # longer looks like a checkpoint (the old metadata went before any rank wrote).
    path = damaged(root, "overwritten", lambda p: None)
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    if dist.get_rank() == 1:  # Python ignores SIGXFSZ: the write fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (200, old[1]))
    try:
        res["disk_full"] = caught(lambda: dcp.save(state, storage_writer=StorageWriter(path)))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
    dist.barrier()
    res["disk_full_left"] = sorted(os.listdir(path))
    return res


def main():
    mode, root, out_path = sys.argv[1:4]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    scenarios = {"save4": [("save", lambda: save(root))] + [
                     (f"load_{lay}", lambda lay=lay: compare_loads(root, lay)) for lay in ("fsdp", "hsdp", "tp")] + [
                     ("faults", lambda: faults(root))],
                 "load3": [("load_fsdp", lambda: compare_loads(root, "fsdp"))]}[mode]
    result = {}
    for name, fn in scenarios:
        result[name] = fn()
        with open(f"{out_path}.{rank}", "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
