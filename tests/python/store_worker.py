"""One rank of test_store.py: `python dcp_store_worker.py MODE ROOT OUT` with torchrun's variables set.

MODE keys: six dcp.loads of ROOT/small (one tensor "w") through shardcast.dcp.HuggingFaceStorageReader over
the default group; the default store's key count after each, taken on rank 0 while the others wait.
MODE wide: one dcp.load of every tensor of ROOT/wide, whose headers rank 0 reads for every rank: more than
the store takes in one value (8 MiB); each rank's tensors compared with the file's.
MODE mapping: shardcast.load of every tensor of ROOT/wide through an explicit mapping, each rank a box of one
element of each: the checkpoint's shapes, which rank 0 reads for every rank, and every rank's boxes, which
every rank reads, are each more than one store value too.
"""
import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

import shardcast
import shardcast.dcp

import ranks


def keys(root):
    path = os.path.join(root, "small")
    ref = load_file(os.path.join(path, "model.safetensors"))["w"]
    store = dist.distributed_c10d._get_default_store()
    counts, ok = [], True
    for _ in range(6):
        sd = {"w": torch.empty_like(ref)}
        dcp.load(sd, storage_reader=shardcast.dcp.HuggingFaceStorageReader(path))
        ok = ok and torch.equal(sd["w"], ref)
        dist.barrier()
        counts.append(store.num_keys())
        dist.barrier()  # rank 0 counts while the others wait: the next load's keys are not yet set
    return {"counts": counts, "ok": ok}


def wide(root):
    path = os.path.join(root, "wide")
    ref = load_file(os.path.join(path, "model.safetensors"))
    sd = {k: torch.empty_like(v) for k, v in ref.items()}
    dcp.load(sd, storage_reader=shardcast.dcp.HuggingFaceStorageReader(path))
    return {"tensors": len(sd), "differ": [k[:40] for k, v in sd.items() if not torch.equal(v, ref[k])][:5]}


def mapping(root):
    path = os.path.join(root, "wide", "model.safetensors")
    ref = load_file(path)
    rank = dist.get_rank()
    local = {k: torch.empty(1) for k in ref}
    shardcast.load({k: (t, (rank,)) for k, t in local.items()}, path, timeout=60)  # boxes, at their offsets
    return {"tensors": len(local), "differ": [k[:40] for k, t in local.items() if not torch.equal(t, ref[k][rank:rank + 1])][:5]}


def main():
    mode, root, out = sys.argv[1:4]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    modes = {"keys": keys, "wide": wide, "mapping": mapping}
    try:  # this rank's result is written before the closing barrier: a peer that fails there loses nothing
        ranks.each_scenario(mode, root, lambda name, at: modes[name](at), f"{out}.{dist.get_rank()}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
