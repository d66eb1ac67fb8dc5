#!/usr/bin/env python3
"""shardcast's load benchmark: shardcast rank0 and each-rank against the full-broadcast baseline
(DCP broadcast_from_rank0 / accelerate), on the same communicator, the same synthesized
Qwen3-MoE-shaped checkpoints and the same report, with a warm page cache and a cold one (every file
evicted with POSIX_FADV_DONTNEED first, which needs no root: real 229B loads are cold). Every run is
`shardcast load --nproc W ... --json`; this script only orchestrates and tabulates.

    bench/bench_load.py [--layers 0,1,3,6,12] [--world-size 4] [--cold] [--out bench/results/load.json]

References, each measured in the same run on the same files:
  - pread into one reused 64 MiB buffer, and into fresh memory (warm), by one process and by W
    processes each landing its 1/W (`bench-pread --fresh --nproc W`): each-rank's bound;
  - a cold sequential read of the files (as `cat` does, 16 MiB reads after eviction): each-rank's bound;
  - a raw c10d scatter of the same bytes into fresh memory (`shardcast-bench bench-scatter`): rank0's
    communication alone, its bound.
Cold loads run with the reader's read-ahead (default) and without it (SHARDCAST_READAHEAD_BYTES=0).
Checkpoints are Qwen3-30B-A3B's config cut to N layers (N=0: 1.2 GB ... N=12: 16 GB). The baseline
runs only where (world size + 1) x checkpoint fits in memory; elsewhere it is reported as not run.
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

from _pagecache import resident

ROOT = pathlib.Path(__file__).resolve().parents[1]


def sh(args, **kw):
    return subprocess.run([str(a) for a in args], check=True, capture_output=True, text=True, **kw)


def mem_total():
    for line in open("/proc/meminfo"):
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def warm(ckpt):
    for f in sorted(ckpt.glob("*.safetensors")):
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass


def evict(ckpt):
    """Drops every file of the checkpoint from the page cache (no root needed for files we can read)."""
    for f in sorted(ckpt.glob("*")):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_fraction(ckpt):
    """Fraction of the checkpoint's pages in the page cache (mincore)."""
    res, size = resident(sorted(ckpt.glob("*.safetensors")))
    return res / size if size else 0.0


def cold_read(ckpt):
    """A cold sequential read of every file, as cat does: the bound for reading from this storage."""
    evict(ckpt)
    total, t0 = 0, time.monotonic()
    for f in sorted(ckpt.glob("*.safetensors")):
        with open(f, "rb", buffering=0) as fh:
            buf = bytearray(16 << 20)
            while True:
                n = fh.readinto(buf)
                if not n:
                    break
                total += n
    secs = time.monotonic() - t0
    return {"bytes": total, "seconds": secs, "gbps": total / secs / 1e9}


def run_load(exe, ckpt, source, world, out_json, env=None):
    t0 = time.monotonic()
    sh([exe, "load", "--checkpoint", ckpt, "--nproc", world, "--source", source, "--quiet", "--json", out_json,
        "--timeout-ms", 900000], env=dict(os.environ, **(env or {})))
    wall = time.monotonic() - t0
    report = json.loads(pathlib.Path(out_json).read_text())
    report["wall_seconds"] = wall
    return report


def summarize(report):
    ranks = report["ranks"]
    slowest = max(r["seconds"] for r in ranks)
    return {
        "seconds": slowest,
        "gbps": report["total_bytes"] / slowest / 1e9,
        "reader_anon": ranks[0]["peak_rss_anon_above_baseline"],
        "reader_file": ranks[0]["peak_rss_file_above_baseline"],
        "other_anon": max((r["peak_rss_anon_above_baseline"] for r in ranks[1:]), default=0),
        "other_file": max((r["peak_rss_file_above_baseline"] for r in ranks[1:]), default=0),
        "node_anon": sum(r["peak_rss_anon_above_baseline"] for r in ranks),
        "node_file": sum(r["peak_rss_file_above_baseline"] for r in ranks),
        "shard": max(r["bytes_stored"] for r in ranks),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="0,1,3,6,12")
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--config", default=str(ROOT / "configs/models/qwen3-30b-a3b.json"))
    ap.add_argument("--work", default=str(ROOT / "out/bench-load"))
    ap.add_argument("--out", default=str(ROOT / "bench/results/load.json"))
    ap.add_argument("--exe", default=str(ROOT / "build/tools/shardcast"))
    ap.add_argument("--bench-exe", default=str(ROOT / "build/bench/shardcast-bench"),
                    help="the benchmarks' command: bench-pread, bench-scatter and load --source baseline")
    ap.add_argument("--cold", action="store_true", help="also run every method with a cold page cache")
    args = ap.parse_args()
    work = pathlib.Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    world = args.world_size
    rows = []
    print(f"{'ckpt GB':>8} {'method':<20} {'seconds':>8} {'GB/s':>6} {'reader anon':>12} {'reader file':>12} "
          f"{'other anon':>11} {'node anon':>10} {'shard':>9}", flush=True)
    for layers in [int(x) for x in args.layers.split(",")]:
        ckpt = work / f"qwen3-L{layers}"
        if not (ckpt / "model.safetensors.index.json").exists():
            sh([args.exe, "synth", "--config", args.config, "--out", ckpt, "--layers", layers,
                "--max-shard-size", "2G", "--seed", "1"])
        size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
        warm(ckpt)
        pread = json.loads(sh([args.bench_exe, "bench-pread", ckpt]).stdout)
        warm(ckpt)
        fresh = json.loads(sh([args.bench_exe, "bench-pread", "--fresh", ckpt]).stdout)
        warm(ckpt)
        bound = json.loads(sh([args.bench_exe, "bench-pread", "--fresh", "--nproc", world, ckpt]).stdout)
        result = {"layers": layers, "checkpoint_bytes": size, "pread_gbps": pread["gbps"],
                  "pread_fresh_gbps": fresh["gbps"], "pread_fresh_nproc_gbps": bound["gbps"], "methods": {}}
        print(f"{size/1e9:8.2f} {'pread (I/O reference)':<20} {pread['seconds']:8.2f} {pread['gbps']:6.2f}", flush=True)
        print(f"{size/1e9:8.2f} {'pread, fresh memory':<20} {fresh['seconds']:8.2f} {fresh['gbps']:6.2f}", flush=True)
        print(f"{size/1e9:8.2f} {f'the same, {world} processes':<20} {bound['seconds']:8.2f} {bound['gbps']:6.2f}",
              flush=True)
        scatter = json.loads(sh([args.bench_exe, "bench-scatter", "--bytes", size, "--nproc", world]).stdout)
        result["scatter_gbps"] = scatter["gbps"]
        print(f"{size/1e9:8.2f} {'raw c10d scatter':<20} {scatter['seconds']:8.2f} {scatter['gbps']:6.2f}", flush=True)
        if args.cold:
            cold = cold_read(ckpt)
            result["cold_read_gbps"] = cold["gbps"]
            print(f"{size/1e9:8.2f} {'cold read (cat)':<20} {cold['seconds']:8.2f} {cold['gbps']:6.2f}", flush=True)
        runs = [("rank0", "warm", None), ("each-rank", "warm", None), ("baseline", "warm", None)]
        if args.cold:
            runs += [("rank0", "cold", None), ("each-rank", "cold", None),
                     ("rank0", "cold, no read-ahead", {"SHARDCAST_READAHEAD_BYTES": "0"}),
                     ("each-rank", "cold, no read-ahead", {"SHARDCAST_READAHEAD_BYTES": "0"})]
        for m, cache, env in runs:
            label = f"{m} ({cache})"
            if m == "baseline" and (world + 1) * size > 0.8 * mem_total():
                result["methods"][label] = {"skipped": f"needs ~{(world + 1) * size / 1e9:.0f} GB of RAM"}
                print(f"{size/1e9:8.2f} {label:<20} {'not run: needs ~%.0f GB RAM' % ((world + 1) * size / 1e9)}",
                      flush=True)
                continue
            if cache == "warm":
                warm(ckpt)
            else:
                evict(ckpt)
                frac = resident_fraction(ckpt)
                if frac > 0.02:
                    print(f"warning: {frac:.0%} of the checkpoint still cached after eviction", flush=True)
            exe = args.bench_exe if m == "baseline" else args.exe
            s = summarize(run_load(exe, ckpt, m, world, work / f"{m}-L{layers}.json", env))
            s["cache"] = cache
            if m == "rank0":
                s["vs_scatter"] = s["gbps"] / scatter["gbps"]
            if cache.startswith("cold") and m == "each-rank":
                s["vs_cold_read"] = s["gbps"] / result["cold_read_gbps"]
            if cache == "warm" and m == "each-rank":  # issue 19's bound: W processes landing the bytes
                s["vs_fresh_bound"] = bound["gbps"] / s["gbps"]
            result["methods"][label] = s
            ratio = (f"  {s['vs_scatter']:.2f}x scatter" if "vs_scatter" in s else "") + \
                    (f"  {s['vs_cold_read']:.2f}x cold read" if "vs_cold_read" in s else "") + \
                    (f"  {s['vs_fresh_bound']:.2f}x the bound's time" if "vs_fresh_bound" in s else "")
            print(f"{size/1e9:8.2f} {label:<28} {s['seconds']:8.2f} {s['gbps']:6.2f} {s['reader_anon']/1e6:10.0f}MB "
                  f"{s['reader_file']/1e6:10.0f}MB {s['other_anon']/1e6:9.0f}MB {s['node_anon']/1e6:8.0f}MB "
                  f"{s['shard']/1e6:7.0f}MB{ratio}", flush=True)
        rows.append(result)
        pathlib.Path(args.out).write_text(json.dumps({"world_size": world, "rows": rows}, indent=2) + "\n")
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    sys.exit(main())
