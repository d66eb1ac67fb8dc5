#!/usr/bin/env python3
"""A training state's save and reshard-load through torch.distributed.checkpoint, shardcast's storage layer
against torch's own: a stack of fp32 Linear layers (--layers x --hidden^2, ~0.4 GB by default) under FSDP2
at world size 4 on CPU/Gloo, with AdamW's exp_avg and exp_avg_sq after one step (so ~3x the model in
all, plus the steps, the param groups and a LambdaLR scheduler's state as DCP byte items), saved by

  shardcast   dcp.save(state, storage_writer=shardcast.dcp.StorageWriter(dir))   (safetensors + JSON)
  shardcast-t4  StorageWriter(dir, thread_count=4)
  torch       dcp.save(state, storage_writer=FileSystemWriter(dir))              (thread_count=1, its default)
  torch-t4    FileSystemWriter(dir, thread_count=4)

and loaded back, resharded to HSDP 2x2 (every rank reads half the state), by shardcast.dcp.StorageReader
and by FileSystemReader (from torch's default checkpoint), each in fresh processes. Both writers fsync
(sync_files defaults True in both). Before every load the checkpoint's files are read once, so the page
cache is warm for everyone; before every save, `sync`, so no one pays for another's writeback.

Each run's time is the slowest rank's dcp.save / dcp.load call; GB/s is the saved state's bytes (every
rank's shards at FSDP 4) over it, decimal. Rank 0 samples its RssAnon/RssFile every 5 ms from just before the call (the
state already in memory: the baseline) and reports the peak above it. Correctness next to every timing:
every rank's CRC32 over its loaded local shards (in key order) must be the same for every reader, and a
save's state CRC must equal the load's on the same layout as saved (checked once, FSDP 4 -> FSDP 4).

    bench/bench_dcp_state.py [--layers 24] [--hidden 2048] [--repeat 3] [--out bench/results/dcp-state.json]

Runs are interleaved (--repeat rounds of every method), and the table shows medians.
"""
import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time
import zlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from _ranks import launch  # noqa: E402
from bench_peers import Sampler  # noqa: E402

SAVERS = ["shardcast", "shardcast-t4", "torch", "torch-t4"]
LOADERS = ["shardcast", "torch"]


def build(layout, layers, hidden):
    """(model, optimizer, scheduler) of `layers` Linear(hidden, hidden) layers; one AdamW step with fixed
    gradients, so every rank's state is the same whatever the layout."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    import torch.distributed as dist
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,)) if layout == "fsdp" else init_device_mesh(
        "cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    for p in model.parameters():
        with torch.no_grad():
            p.to_local().fill_(0.5)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 0.9 ** s)
    return model, optim, sched


def state_of(model, optim, sched):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd, "scheduler": sched.state_dict(), "dataloader": {"epoch": 1, "pos": (3, 7)}}


def local_crc(state):
    """CRC32 over this rank's local tensors and every other value's repr, in key order; and their bytes."""
    import torch
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.tensor import DTensor
    flat, _ = flatten_state_dict(state)
    crc, nbytes = 0, 0
    for k in sorted(flat):
        v = flat[k]
        if isinstance(v, DTensor):
            v = v.to_local()
        if isinstance(v, torch.Tensor):
            b = v.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            crc, nbytes = zlib.crc32(b, crc), nbytes + b.nbytes
        else:
            crc = zlib.crc32(repr(v).encode(), crc)
    return crc, nbytes


def worker(op, method, layout, ckpt, result, layers, hidden):
    import datetime
    import gc
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from shardcast.dcp._state import StorageReader, StorageWriter
    layers, hidden = int(layers), int(hidden)
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
    rank = dist.get_rank()
    model, optim, sched = build(layout, layers, hidden)
    if op == "save":
        from torch.distributed.tensor import DTensor
        for p in model.parameters():
            p.grad = DTensor.from_local(torch.full_like(p.to_local(), 0.25), p.device_mesh, p.placements,
                                        shape=p.shape, stride=p.stride())
        optim.step()
        sched.step()
    state = state_of(model, optim, sched)  # a fresh optimizer's state is initialized here (DCP's own step)
    if op == "save":
        threads = 4 if method.endswith("-t4") else 1
        writer = (StorageWriter(ckpt, thread_count=threads) if method.startswith("shardcast") else
                  dcp.FileSystemWriter(ckpt, thread_count=threads))
        call = lambda: dcp.save(state, storage_writer=writer)  # noqa: E731
    else:
        reader = StorageReader(ckpt) if method == "shardcast" else dcp.FileSystemReader(ckpt)
        call = lambda: dcp.load(state, storage_reader=reader)  # noqa: E731
    gc.collect()
    dist.barrier()
    sampler = Sampler()
    sampler.start()
    t0 = time.monotonic()
    call()
    seconds = time.monotonic() - t0
    sampler.stop = True
    sampler.join()
    crc, nbytes = local_crc(state)
    pathlib.Path(f"{result}.{rank}").write_text(json.dumps({
        "rank": rank, "seconds": seconds, "state_bytes": nbytes, "crc": crc,
        "peak_rss_anon": sampler.peak["RssAnon"] - sampler.base["RssAnon"],
        "peak_rss_file": sampler.peak["RssFile"] - sampler.base["RssFile"]}))
    dist.destroy_process_group()


def warm(d):
    for f in pathlib.Path(d).iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(64 << 20):
                    pass


def run(args, op, method, layout, ckpt, work):
    ranks = launch(__file__, [op, method, layout, ckpt, work / f"{op}-{method}", args.layers, args.hidden],
                   args.world_size, work / f"{op}-{method}", f"{op} {method}", timeout_s=1800)
    return {"seconds": max(r["seconds"] for r in ranks), "crcs": [r["crc"] for r in ranks],
            "state_bytes": sum(r["state_bytes"] for r in ranks),
            "r0_peak_rss_anon": ranks[0]["peak_rss_anon"], "r0_peak_rss_file": ranks[0]["peak_rss_file"]}


def median(runs, key):
    return sorted(r[key] for r in runs)[len(runs) // 2]


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(*sys.argv[2:9])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--work", default=str(ROOT / "out/bench-dcp-state"))
    ap.add_argument("--out", default=str(ROOT / "bench/results/dcp-state.json"))
    args = ap.parse_args()
    work = pathlib.Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    ckpt = {m: work / f"ckpt-{m}" for m in SAVERS}
    runs = {f"save {m}": [] for m in SAVERS}
    runs.update({f"load {m}": [] for m in LOADERS})
    for _ in range(args.repeat):  # interleaved: drift on a shared machine hits every method alike
        for m in SAVERS:
            shutil.rmtree(ckpt[m], ignore_errors=True)
            subprocess.run(["sync"], check=False)
            runs[f"save {m}"].append(run(args, "save", m, "fsdp", ckpt[m], work))
        for m in LOADERS:
            warm(ckpt[m])
            runs[f"load {m}"].append(run(args, "load", m, "hsdp", ckpt[m], work))
    same_layout = run(args, "load", "shardcast", "fsdp", ckpt["shardcast"], work)  # FSDP 4 -> FSDP 4
    saved_crcs = runs["save shardcast"][0]["crcs"]
    ok = {"save": all(r["crcs"] == saved_crcs for k, rs in runs.items() if k.startswith("save") for r in rs)
          and same_layout["crcs"] == saved_crcs,
          "load": all(r["crcs"] == runs["load torch"][0]["crcs"] for k, rs in runs.items() if k.startswith("load")
                      for r in rs)}
    state = runs["save shardcast"][0]["state_bytes"]
    disk = {m: sum(f.stat().st_size for f in ckpt[m].iterdir()) for m in SAVERS}
    print(f"state {state / 1e9:.2f} GB (model + AdamW), world size {args.world_size}, FSDP {args.world_size} save, "
          f"HSDP 2x{args.world_size // 2} load, warm page cache, median of {args.repeat}")
    print(f"{'method':<16} {'seconds':>8} {'GB/s':>6} {'r0 anon':>9} {'r0 file':>9}  ok  all seconds")
    table = {}
    for name, rs in runs.items():
        sec = median(rs, "seconds")
        table[name] = {"seconds": sec, "gb_per_s": state / sec / 1e9, "r0_peak_rss_anon": max(r["r0_peak_rss_anon"] for r in rs),
                       "r0_peak_rss_file": max(r["r0_peak_rss_file"] for r in rs),
                       "all_seconds": [r["seconds"] for r in rs], "ok": ok[name.split()[0]]}
        t = table[name]
        print(f"{name:<16} {sec:8.2f} {t['gb_per_s']:6.2f} {t['r0_peak_rss_anon'] / 1e6:7.0f}MB "
              f"{t['r0_peak_rss_file'] / 1e6:7.0f}MB {str(t['ok']):>5}  {', '.join(f'{s:.2f}' for s in t['all_seconds'])}")
    print("on disk: " + ", ".join(f"{m} {disk[m] / 1e9:.3f} GB" for m in SAVERS))
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps({"state_bytes": state, "world_size": args.world_size,
                                                  "layers": args.layers, "hidden": args.hidden, "repeat": args.repeat,
                                                  "disk_bytes": disk, "results": table}, indent=2) + "\n")
    if not all(ok.values()):
        raise SystemExit(f"a state differs: {ok}")


if __name__ == "__main__":
    sys.exit(main())
