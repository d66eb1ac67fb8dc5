"""bench_peers.py's tables: the methods' medians (the slowest rank's total and phases, the peaks), and
from_pretrained's own split of its set-up per rank."""
import os

PHASES = ("import", "build", "shard", "load")


def summary(ranks, folded: bool):
    """The slowest rank's total and phases (None for build and shard where `folded` into load: one
    from_pretrained call); rank 0's peaks; the other ranks' highest."""
    return {"seconds": max(r["seconds"] for r in ranks), "node_cpu_seconds": sum(r.get("cpu_seconds", 0) for r in ranks),
            "gc_after_seconds": max(r.get("gc_after_seconds", 0) for r in ranks),
            "phases": {p: None if folded and p in ("build", "shard") else max(r["phases"][p] for r in ranks)
                       for p in PHASES},
            "rank0_anon": ranks[0]["peak_rss_anon"], "rank0_file": ranks[0]["peak_rss_file"],
            "others_anon": max((r["peak_rss_anon"] for r in ranks[1:]), default=0),
            "source": ranks[0].get("source")}


def print_phases(results):
    """from_pretrained's own split of its set-up, per rank (the median run's), for the methods that call it."""
    shown = {m: ranks for m, ranks in results.items() if all("pretrained_phases" in r for r in ranks)}
    if not shown:
        return
    names = [p for p in next(iter(shown.values()))[0]["pretrained_phases"] if p not in ("total", "cpu")]
    print("from_pretrained by phase, each rank, seconds (stream beside build and layout: only its wait adds up; "
          "cpu: the rank's CPU time over the call, every thread; /max: the total over the longer of the build "
          "side (config, import, build, layout) and the stream, as they ran)")
    print(f"{'method':<34} {'rank':>4} " + " ".join(f"{p:>7}" for p in names) + f" {'total':>7} {'cpu':>7} {'/max':>5}")
    for m, ranks in shown.items():
        for r in ranks:
            ph = r["pretrained_phases"]
            print(f"{m:<34} {r['rank']:>4} " + " ".join(f"{ph[p]:7.2f}" for p in names) + f" {ph['total']:7.2f}"
                  f" {ph.get('cpu', 0.0):7.2f} {over_longer(ph):5.2f}")


def over_longer(phases) -> float:
    """A rank's from_pretrained total over the longer of its two sides: the build side (config, import,
    build, layout: the main thread's work before it waits) and the stream (issue 34: <= 1.1)."""
    build_side = sum(phases.get(p, 0.0) for p in ("config", "import", "build", "layout"))
    return phases["total"] / max(build_side, phases.get("stream", 0.0), 1e-9)


def print_table(summaries, size, args, resident, layout):
    """The methods' medians, one row each; `layout`: the distributed config the run used (printed)."""
    seen = [b / 1e9 for b in resident]
    cached = f"{min(seen):.2f}-{max(seen):.2f} GB resident before each method"
    print(f"{args.model} checkpoint {size / 1e9:.2f} GB ({args.layers} layers), world size {args.world_size}, layout "
          f"{args.layout} {layout}, "
          f"{'cold' if args.cold else 'warm'} page cache ({cached}), median of {args.repeat} run(s)")
    print(f"{'method':<34} {'total s':>8} " + " ".join(f"{p:>7}" for p in PHASES)
          + f" {'r0 anon':>8} {'r0 file':>8} {'oth anon':>8} {'node cpu':>8} {'cores':>5} {'gc after':>8}")
    for m, s in summaries.items():
        phases = " ".join("      -" if s["phases"][p] is None else f"{s['phases'][p]:7.2f}" for p in PHASES)
        print(f"{m:<34} {s['seconds']:8.2f} {phases} {s['rank0_anon'] / 1e9:6.2f}GB {s['rank0_file'] / 1e9:6.2f}GB "
              f"{s['others_anon'] / 1e9:6.2f}GB {s['node_cpu_seconds']:7.2f}s {s['node_cpu_seconds'] / s['seconds']:5.2f}"
              f" {s['gc_after_seconds']:7.2f}s"
              + (f"  (source {s['source']})" if s["source"] else ""))
    print(f"-: folded into load (one from_pretrained call). node cpu: the ranks' CPU seconds over the run, added; "
          f"cores: that over the total (this machine has {len(os.sched_getaffinity(0))}): where it is near "
          f"the machine's cores, the run is bound by CPU. gc after: one full gc.collect() after the timed part, "
          f"slowest rank (not in the total)")
