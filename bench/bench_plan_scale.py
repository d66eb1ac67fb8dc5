#!/usr/bin/env python3
"""One rank's setup at scale: `shardcast plan --schedule` derives rank R's plan, manifest (resolved against a
sparse synthetic checkpoint), check and its part of the schedule in one process, with no other ranks, and
reports seconds, CPU seconds, messages and peak RSS (VmHWM from /proc). Run for DeepSeek-V3 and MiniMax-M2
at W = 8, 256, 1024, 4096 under FSDP, HSDP (mesh 8 x W/8: 8 replica groups) and EP x FSDP (TP and EP over 8
ranks, FSDP over W/8: runtime/layout/parallel_plan.h), source striped, rank 5 (an ordinary rank: not the reader of
broadcasts). "before" walks the whole schedule once with today's code, which is what every rank did (engine,
ring reader, read-ahead and the plan walk: four times per load, and verify once more for every rank).

    bench/bench_plan_scale.py [--runs 3] [--worlds 8,256,1024,4096] [--out bench/results/plan-scale.json]

Each figure is the median of --runs runs, interleaved over the cases. The synthetic checkpoints (sparse: no
data on disk) are written once into --work (default /tmp/shardcast-plan-scale) by `shardcast synth --sparse`.
"""
import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODELS = {"deepseek-v3": "deepseek-v3.json", "minimax-m2": "minimax-m2.json"}
LAYOUTS = {"fsdp": [], "hsdp": ["--replicas", "8"], "ep-fsdp": ["--tp", "8"]}
RANK = 5


def config_path(name):
    for d in (ROOT / "configs/models", pathlib.Path("/work/shared/models")):
        if (d / MODELS[name]).exists():
            return d / MODELS[name]
    raise SystemExit(f"no config for {name} in configs/models or /work/shared/models")


def shardcast():
    return str(pathlib.Path(os.environ.get("SHARDCAST_BUILD_DIR", ROOT / "build")) / "tools/shardcast")


def synth(model, work):
    out = work / model
    if not (out / "model.safetensors.index.json").exists():
        subprocess.run([shardcast(), "synth", "--config", str(config_path(model)), "--out", str(out), "--sparse",
                        "--max-shard-size", str(5 * 10**9)], check=True, stdout=subprocess.DEVNULL)
    return out


def plan(model, ckpt, world, layout, whole):
    cmd = [shardcast(), "plan", "--config", str(config_path(model)), "--world-size", str(world), "--rank", str(RANK),
           "--schedule", "--checkpoint", str(ckpt), "--json"] + LAYOUTS[layout] + (["--whole"] if whole else [])
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def median_of(runs):
    """One row: the medians of the timings and the peak, the counts (identical across runs) from the first."""
    row = {k: runs[0][k] for k in ("world_size", "layout", "source", "whole", "entries", "messages",
                                   "messages_walked", "segments", "bytes_read", "bytes_received", "bytes_kept")}
    for k in ("seconds", "cpu_seconds", "peak_rss_bytes", "peak_rss_above_baseline_bytes"):
        row[k] = statistics.median(r[k] for r in runs)
    for step in runs[0]["steps"]:
        row[f"{step}_cpu_seconds"] = statistics.median(r["steps"][step]["cpu_seconds"] for r in runs)
    row["schedule_rss_growth_bytes"] = statistics.median(
        r["steps"]["schedule"]["rss_bytes"] - r["steps"]["check"]["rss_bytes"] for r in runs)
    row["runs"] = len(runs)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--worlds", default="8,256,1024,4096")
    ap.add_argument("--before-worlds", default="8,256,1024", help="worlds at which to time the whole walk (FSDP)")
    ap.add_argument("--work", default="/tmp/shardcast-plan-scale")
    ap.add_argument("--out", default=str(ROOT / "bench/results/plan-scale.json"))
    args = ap.parse_args()
    work = pathlib.Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    worlds = [int(w) for w in args.worlds.split(",")]
    cases = [(m, w, l, False) for m in MODELS for w in worlds for l in LAYOUTS]
    cases += [(m, int(w), "fsdp", True) for m in MODELS for w in args.before_worlds.split(",") if w]
    ckpts = {m: synth(m, work) for m in MODELS}
    results = {c: [] for c in cases}
    for run in range(args.runs):  # interleaved: every case once per round
        for c in cases:
            m, w, l, whole = c
            results[c].append(plan(m, ckpts[m], w, l, whole))
            r = results[c][-1]
            print(f"run {run} {m} W={w} {l}{' whole' if whole else ''}: {r['messages']} messages, "
                  f"{r['cpu_seconds']:.3f} s CPU, peak {r['peak_rss_bytes'] / 2**20:.1f} MiB", flush=True)
    rows = [dict(median_of(results[c]), model=c[0], layout=c[2]) for c in cases]
    load = os.getloadavg()
    doc = {"machine": f"{platform.machine()} {os.cpu_count()} vCPU, {platform.platform()}",
           "load_average_at_end": [round(x, 2) for x in load], "rank": RANK, "rows": rows}
    pathlib.Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{'model':12} {'W':>5} {'layout':8} {'walk':6} {'messages':>9} {'walked':>9} {'CPU s':>7} "
          f"{'sched CPU s':>11} {'peak MiB':>9} {'above MiB':>9}")
    for r in rows:
        print(f"{r['model']:12} {r['world_size']:5} {r['layout']:8} {'whole' if r['whole'] else 'rank':6} "
              f"{r['messages']:9} {r['messages_walked']:9} {r['cpu_seconds']:7.3f} {r['schedule_cpu_seconds']:11.3f} "
              f"{r['peak_rss_bytes'] / 2**20:9.1f} {r['peak_rss_above_baseline_bytes'] / 2**20:9.1f}")


if __name__ == "__main__":
    main()
