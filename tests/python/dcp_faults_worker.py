"""One rank of a shardcast.dcp fault launch (tests/python/test_dcp_faults.py): rank 0, which reads the
headers for everyone and hosts the store, killed or frozen by SHARDCAST_FAULT at its point. Each surviving
rank writes what it raised and how long it took to OUT.<rank> (JSON); a rank that never returns is caught
by the harness's deadline.

    python dcp_faults_worker.py MODE ROOT OUT

metadata:  dcp.load through HuggingFaceStorageReader(ROOT/hf, timeout=2) while rank 0 dies or freezes
           before it answers read_metadata (SHARDCAST_FAULT=0:metadata:kill|stop). The group's timeout is
           then 3 s (10 s for its start-up): DCP's own gather to a frozen rank 0 waits that long.
hf-save:   dcp.save of FSDP-sharded DTensors through HuggingFaceStorageWriter(ROOT/hf) over the checkpoint
           there, while rank 0 dies at its second write (0:save-write:kill:2).
state-save: dcp.save through StorageWriter(ROOT/state) over the training state there, likewise.
"""
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import shardcast.dcp as sdcp

# The checkpoint the test writes (tests/python/test_dcp_faults.py: SHAPES), as DTensors over all ranks.
SHAPES = {"a.weight": (37, 5), "b.weight": (11,), "c.weight": (6, 129)}


def sharded_state(world):
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(7)
    return {k: distribute_tensor(torch.randn(s, generator=g).to(torch.bfloat16), mesh, [Shard(0)])
            for k, s in SHAPES.items()}


def main():
    mode, root, out = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    sd = sharded_state(world)
    result = {}
    t0 = time.monotonic()
    try:
        if mode == "metadata":
            dist.set_timeout(datetime.timedelta(seconds=3))  # what a frozen rank 0 costs DCP's gather after ours
            class Reader(sdcp.HuggingFaceStorageReader):  # what read_metadata itself raised, and when
                def read_metadata(self):
                    try:
                        return super().read_metadata()
                    except BaseException as e:
                        result["read_metadata"] = [type(e).__name__, str(e), time.monotonic() - t0]
                        raise

            dcp.load({k: torch.empty_like(v) for k, v in sd.items()},
                     storage_reader=Reader(os.path.join(root, "hf"), timeout=2))
        elif mode == "hf-save":
            dcp.save(sd, storage_writer=sdcp.HuggingFaceStorageWriter(os.path.join(root, "hf"), chunk_bytes="4K",
                                                                       timeout=5))
        elif mode == "state-save":
            dcp.save({"model": sd, "step": 12}, storage_writer=sdcp.StorageWriter(os.path.join(root, "state")))
        result["error"] = None
    except BaseException as e:  # noqa: BLE001 -- DCP's CheckpointException is a BaseException
        result["error"] = f"{type(e).__name__}: {e}"
        failures = getattr(e, "failures", None) or {rank: (e, None)}  # CheckpointException: per rank
        result["causes"] = sorted({type(x[0]).__name__ if isinstance(x, tuple) else type(x).__name__
                                   for x in failures.values()})
    result["seconds"] = time.monotonic() - t0
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    os._exit(0)  # no teardown: rank 0 is gone


if __name__ == "__main__":
    main()
