#!/usr/bin/env python3
"""Saving FSDP2 shards as a Hugging Face checkpoint, side by side with the real peers: the same model
(Qwen3-MoE, ~2 GB bf16, the checkpoint bench_peers.py loads), loaded into FSDP2 shards at world size 4
on CPU/Gloo by shardcast, then saved by

  shardcast-each-rank  shardcast.save(model, out, source="each-rank"): every rank pwrites its own rows
  shardcast-rank0      shardcast.save(model, out, source="rank0"): ranks stream their rows to rank 0
  accelerate           Accelerator.get_state_dict's FSDP2 path (get_model_state_dict with
                       full_state_dict=True, broadcast_from_rank0=True, cpu_offload=True), then rank 0's
                       save_pretrained(state_dict=...), as accelerate's save_model does
  dcp                  torch.distributed.checkpoint.save with HuggingFaceStorageWriter(save_distributed=True,
                       enable_consolidation=True): every rank writes its shard files, rank 0 consolidates

each in its own run (fresh processes). Each rank samples its own /proc/self/status every 5 ms from just
before the save (its shards already loaded: the baseline), and /proc/self/io's write_bytes (bytes this
process dirtied for storage: temporary copies included). Wall time is the slowest rank's; `durable`
adds rank 0's fsync of every output file afterwards (shardcast already synced; the peers do not sync
everything themselves). Correctness next to every timing: every output loaded by from_pretrained must
give the same state dict (CRC32 over every tensor, in key order) as the checkpoint the model came from.

    bench/bench_save.py [--world-size 4] [--layers 12] [--methods ...] [--repeat 3] [--out bench/results/save.json]

Timings on a shared 2-core VM vary 2-3x between identical runs: every method runs --repeat times,
interleaved, and the table shows each one's median wall time (all of them listed) and its largest
memory peaks over all runs.
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
from bench_peers import Sampler, write_checkpoint  # noqa: E402  (same model, same sampler)

METHODS = ["shardcast-each-rank", "shardcast-rank0", "accelerate", "dcp"]
SHARD = "500MB"


def io_written():
    with open("/proc/self/io") as f:
        v = dict(line.split(": ") for line in f.read().splitlines())
    return int(v["write_bytes"]), int(v["cancelled_write_bytes"])


def loaded_model(ckpt, mesh):
    import torch
    import shardcast
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(ckpt)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    shardcast.prepare(model, config=config)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    shardcast.load(model, ckpt)
    return model


def dcp_mapping(model):
    """fqn -> file index (1..N), greedy by SHARD in state-dict order, as save_pretrained splits."""
    limit, index, size, out = 500_000_000, 1, 0, {}
    for k, v in model.state_dict().items():
        n = v.numel() * v.element_size()
        if size and size + n > limit:
            index, size = index + 1, 0
        out[k] = index
        size += n
    return out


def save(method, model, out, rank):
    import torch.distributed as dist
    if method.startswith("shardcast"):
        import shardcast
        report = shardcast.save(model, out, source=method.split("-", 1)[1], max_shard_size=SHARD, timeout=1800)
        dist.barrier()
        return {k: v for k, v in report["ranks"][rank].items() if k.endswith("seconds")}
    elif method == "accelerate":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, cpu_offload=True)
        state_dict = get_model_state_dict(model, options=options)
        if rank == 0:
            model.save_pretrained(out, state_dict=state_dict, max_shard_size=SHARD)
        del state_dict
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageWriter
        writer = HuggingFaceStorageWriter(out, fqn_to_index_mapping=dcp_mapping(model), save_distributed=True,
                                          enable_consolidation=True)
        dcp.save(model.state_dict(), storage_writer=writer)
        if rank == 0:
            model.config.save_pretrained(out)
    dist.barrier()
    return None


def worker(method, ckpt, out, result):
    import datetime
    import gc
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = loaded_model(ckpt, init_device_mesh("cpu", (world,)))
    shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    gc.collect()
    dist.barrier()
    w0, c0 = io_written()
    sampler = Sampler()
    sampler.start()
    t0 = time.monotonic()
    report = save(method, model, out, rank)
    seconds = time.monotonic() - t0
    sampler.stop = True
    sampler.join()
    w1, c1 = io_written()
    sync = 0.0
    if rank == 0:
        t = time.monotonic()
        for dirpath, _, files in os.walk(out):
            for f in files:
                fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
        sync = time.monotonic() - t
    r = {"rank": rank, "seconds": seconds, "sync_seconds": sync, "shard_bytes": shard,
         "written_bytes": w1 - w0, "cancelled_write_bytes": c1 - c0,
         "peak_rss_anon": sampler.peak["RssAnon"] - sampler.base["RssAnon"],
         "peak_rss_file": sampler.peak["RssFile"] - sampler.base["RssFile"],
         "baseline_rss_anon": sampler.base["RssAnon"], "shardcast_report": report}
    pathlib.Path(f"{result}.{rank}").write_text(json.dumps(r))
    dist.destroy_process_group()


def disk_bytes(d):
    return sum(os.path.getsize(os.path.join(p, f)) for p, _, fs in os.walk(d) for f in fs)


def state_crc(path):
    """CRC32 over every tensor of from_pretrained(path).state_dict(), in key order, and the keys' count."""
    import torch
    from transformers import AutoModelForCausalLM
    sd = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).state_dict()
    crc = 0
    for k in sorted(sd):
        crc = zlib.crc32(sd[k].contiguous().view(-1).view(torch.uint8).numpy().tobytes(), crc)
    return crc, len(sd)


def peak(runs, key, rank0):
    """The largest `key` over every run, on rank 0 or on the other ranks."""
    return max(r[key] for run in runs for r in (run["ranks"][:1] if rank0 else run["ranks"][1:]))


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(*sys.argv[2:6])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--repeat", type=int, default=3, help="runs of each method, interleaved; the table shows the median")
    ap.add_argument("--work", default=str(ROOT / "out/bench-peers"))
    ap.add_argument("--out", default=str(ROOT / "bench/results/save.json"))
    args = ap.parse_args()
    work = pathlib.Path(args.work)
    ckpt = work / f"qwen3-moe-{args.layers}L"
    if not (ckpt / "model.safetensors.index.json").exists():
        write_checkpoint(ckpt, args.layers)
    size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    want = state_crc(ckpt)
    runs = {m: [] for m in args.methods.split(",")}
    for rep in range(args.repeat):  # interleaved, so drift on a shared machine hits every method alike
        for method in runs:
            out = work / f"saved-{method}"
            shutil.rmtree(out, ignore_errors=True)
            for f in ckpt.glob("*.safetensors"):  # the same warm page cache for everyone's load
                f.read_bytes()
            subprocess.run(["sync"], check=False)  # no one pays for another's writeback
            ranks = launch(__file__, [method, ckpt, out, work / f"save-{method}"], args.world_size,
                           work / f"save-{method}", method, timeout_s=3600)
            run = {"ranks": ranks, "seconds": max(r["seconds"] for r in ranks),
                   "output_bytes_on_disk": disk_bytes(out), "written_bytes": sum(r["written_bytes"] for r in ranks)}
            if rep == 0:
                crc = state_crc(out)
                run.update(identical=crc == want, keys=crc[1])
            runs[method].append(run)
            shutil.rmtree(out, ignore_errors=True)
    print(f"checkpoint {size / 1e9:.2f} GB, world size {args.world_size}, median of {args.repeat} run(s)")
    print(f"{'method':<20} {'seconds':>8} {'durable':>8} {'r0 anon':>9} {'r0 file':>9} {'other anon':>10} "
          f"{'other file':>10} {'written':>9} {'x size':>6} {'on disk':>8} ok")
    results = {}
    for m, rs_all in runs.items():
        med = sorted(rs_all, key=lambda r: r["seconds"])[len(rs_all) // 2]
        rs = med["ranks"]
        results[m] = {"median": med, "all_seconds": [r["seconds"] for r in rs_all], "identical": rs_all[0]["identical"],
                      "keys": rs_all[0]["keys"], "runs": rs_all}
        print(f"{m:<20} {med['seconds']:8.2f} {med['seconds'] + rs[0]['sync_seconds']:8.2f} "
              f"{peak(rs_all, 'peak_rss_anon', True) / 1e9:7.2f}GB {peak(rs_all, 'peak_rss_file', True) / 1e9:7.2f}GB "
              f"{peak(rs_all, 'peak_rss_anon', False) / 1e9:8.2f}GB {peak(rs_all, 'peak_rss_file', False) / 1e9:8.2f}GB "
              f"{med['written_bytes'] / 1e9:7.2f}GB {med['written_bytes'] / size:6.2f} "
              f"{med['output_bytes_on_disk'] / 1e9:6.2f}GB {rs_all[0]['identical']}  "
              f"(all: {', '.join(f'{r:.2f}' for r in sorted(results[m]['all_seconds']))})")
    pathlib.Path(args.out).write_text(json.dumps({"checkpoint_bytes": size, "world_size": args.world_size,
                                                  "repeat": args.repeat, "results": results}, indent=2) + "\n")
    if not all(r["identical"] for r in results.values()):
        raise SystemExit("an output differs from the checkpoint the model was loaded from")


if __name__ == "__main__":
    sys.exit(main())
