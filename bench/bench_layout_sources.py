#!/usr/bin/env python3
"""Storage bytes read and bytes sent per source on the layouts transformers' DistributedConfig makes
(EP x FSDP: experts on their own mesh; TP x FSDP), through the real user call
`shardcast.from_pretrained(path, distributed_config=DistributedConfig(...), source=S)`, W ranks over
Gloo, two "nodes" (GROUP_RANK) so node-leader has two readers. Read-once sources must read every byte
once (1.00x); each-rank reads R x only across replicas.

    bench/bench_layout_sources.py --checkpoint DIR [--world-size 4] [--out bench/results/layout-sources.json]

The JSON keeps one entry per world size ("W=4", "W=8"), each run replacing its own.

The checkpoint: a transformers MoE saved by save_pretrained (bench/bench_peers.py writes qwen3-moe-12L).
"""
import argparse
import json
import pathlib
import sys
import time

from _ranks import ROOT, launch


def layouts(world):
    """EP x FSDP and TP x FSDP for a world of `world`, in the sizes transformers' DistributedConfig takes."""
    return [{"ep_size": 2, "fsdp_size": world}, {"tp_size": 2, "fsdp_size": world // 2}]
SOURCES = ["rank0", "each-rank", "node-leader", "striped"]


def worker(ckpt, out, spec, source):
    import torch
    import torch.distributed as dist
    from transformers.distributed import DistributedConfig

    import shardcast
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t0 = time.monotonic()
    model = shardcast.from_pretrained(ckpt, distributed_config=DistributedConfig(**json.loads(spec)), source=source,
                                      dtype=torch.bfloat16)
    seconds = time.monotonic() - t0
    report = model.shardcast_report
    mine = report["ranks"][rank]
    pathlib.Path(f"{out}.{rank}").write_text(json.dumps({
        "seconds": seconds, "source": report["source"], "mesh": report["mesh"],
        "checkpoint_bytes": report["checkpoint_bytes"], "bytes_read": mine["bytes_read"],
        "bytes_sent": mine["bytes_sent"], "bytes_stored": mine["bytes_stored"],
        "peak": mine["peak_rss_anon_above_baseline"] + mine["peak_rss_file_above_baseline"]}))
    dist.destroy_process_group()


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(*sys.argv[2:6])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "bench/results/layout-sources.json"))
    args = ap.parse_args()
    rows = []
    tmp = pathlib.Path("/tmp/shardcast-layout-sources")
    for spec in layouts(args.world_size):
        for source in SOURCES:
            ranks = launch(__file__, [args.checkpoint, tmp, json.dumps(spec), source], args.world_size, tmp,
                           f"{json.dumps(spec)} {source}", timeout_s=1800,
                           rank_env=lambda r: {"GROUP_RANK": str(r * 2 // args.world_size)})
            ckpt = ranks[0]["checkpoint_bytes"]
            row = {"layout": spec, "source": ranks[0]["source"], "mesh": ranks[0]["mesh"], "checkpoint_bytes": ckpt,
                   "read": sum(r["bytes_read"] for r in ranks), "sent": sum(r["bytes_sent"] for r in ranks),
                   "stored": sum(r["bytes_stored"] for r in ranks),
                   "seconds": max(r["seconds"] for r in ranks), "busiest_peak": max(r["peak"] for r in ranks)}
            rows.append(row)
            print(f"W={args.world_size} {spec} {row['source']:<12} read {row['read'] / ckpt:.2f}x, "
                  f"sent {row['sent'] / 1e9:.2f} GB, stored {row['stored'] / 1e9:.2f} GB, "
                  f"{row['seconds']:.2f} s, busiest rank peak {row['busiest_peak'] / 1e6:.0f} MB", flush=True)
    out = pathlib.Path(args.out)
    runs = json.loads(out.read_text()) if out.exists() else {}
    runs[f"W={args.world_size}"] = rows
    out.write_text(json.dumps(runs, indent=1) + "\n")


if __name__ == "__main__":
    main()
