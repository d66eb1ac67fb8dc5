#!/usr/bin/env python3
"""The store exchange every from_pretrained makes (whether each rank can stream, every rank's phases), at
W ranks: `shardcast._exchange.gathered` (each rank sets its value, waits for all W keys and reads them in one
multi_get: 4 requests a rank) against the previous way, kept here as the baseline (the same but for its
reads, one get a key: W + 3 requests a rank, W^2 in all), both over one real c10d TCPStore.

W ranks are W threads, spread over --procs processes, each with its own TCPStore client (its own socket), as
W processes would have; the store's server runs in the parent process, which only waits. The value is a
from_pretrained first-exchange answer (a reason, a hostname, a boot id, a 64-CPU mask). Each method makes
--exchanges exchanges in a row; the time is from the moment every rank is told to go (after a barrier) to
the end of the last rank's last exchange, and the median of --repeat interleaved runs is printed with the
store requests it makes (from the code, not counted). Every rank checks it got every rank's value in rank
order.

    bench/bench_exchange.py [--world 64,256,1024] [--procs 8] [--exchanges 3] [--repeat 3]
"""
import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from datetime import timedelta

# the built package (SHARDCAST_BUILD_DIR, default build/), as bench/_ranks.py gives its ranks
sys.path.insert(0, os.path.join(os.environ.get("SHARDCAST_BUILD_DIR", os.path.join(os.path.dirname(
    os.path.abspath(__file__)), "..", "build")), "python"))

METHODS = ("through-one-read", "every-rank-reads-all")


def answer(rank):
    return [None, True, f"node{rank // 8}", f"boot-{rank // 8:04d}-4c1f-9a2e", format((1 << 64) - 1, "x")]


def every_rank_reads_all(ch, rank, world, value, timeout_s):
    """The baseline: gathered as it was before (git show 009718e:python/shardcast/_exchange.py), the same
    calls through the same deadline machinery, but for its reads: W gets, one per key."""
    from shardcast._exchange import _forget, _key, _left, _next, _through_store
    n = _next(ch)
    keys = [_key(n, r) for r in range(world)]
    deadline = time.monotonic() + timeout_s

    def exchange(store):
        if rank == 0:
            _forget(store, n, world)
        store.set(_key(n, rank), json.dumps(value))
        store.append(_key(n, "who"), f"{rank} ")
        store.wait(keys, _left(deadline))
        return [json.loads(store.get(k)) for k in keys]

    return _through_store(ch, exchange, timeout_s, "baseline", who=(_key(n, "who"), world))


def rank_thread(method, port, rank, world, exchanges, start, out):
    import torch.distributed as dist
    from shardcast._exchange import gathered
    store = dist.TCPStore("127.0.0.1", port, world + 1, False, timeout=timedelta(seconds=600))
    prefix = dist.PrefixStore(f"{method}/{start}", store)
    ch = (prefix, f"bench-{method}-{start}-{rank}", "127.0.0.1", {})  # a channel per rank: its own count
    want = [answer(r) for r in range(world)]
    store.add(f"{method}/{start}/ready", 1)
    store.wait([f"{method}/{start}/go"], timedelta(seconds=600))
    ok = True
    for _ in range(exchanges):
        if method == "through-one-read":
            got = gathered(ch, rank, world, answer(rank), 600.0)
        else:
            got = every_rank_reads_all(ch, rank, world, answer(rank), 600.0)
        ok = ok and got == want
    out.append((time.monotonic(), ok))  # CLOCK_MONOTONIC: one clock for every process on this host


def proc(method, port, ranks, world, exchanges, start, queue):
    out = []
    threads = [threading.Thread(target=rank_thread, args=(method, port, r, world, exchanges, start, out))
               for r in ranks]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    queue.put(out)


def run(method, port, world, procs, exchanges, start, store):
    """(seconds from the moment every rank was told to go to the last rank's end, every rank got what it
    should)."""
    ctx = mp.get_context("spawn")  # not fork: this process runs the store's server thread
    queue = ctx.Queue()
    share = [list(range(p, world, procs)) for p in range(procs)]
    ps = [ctx.Process(target=proc, args=(method, port, share[p], world, exchanges, start, queue)) for p in range(procs)]
    for p in ps:
        p.start()
    while int(store.add(f"{method}/{start}/ready", 0)) < world:
        time.sleep(0.01)
    go = time.monotonic()
    store.set(f"{method}/{start}/go", "1")
    results = [r for _ in ps for r in queue.get()]
    for p in ps:
        p.join()
    assert len(results) == world
    return max(end for end, _ in results) - go, all(ok for _, ok in results)


def requests(method, world, exchanges):
    """Store requests a run makes, from the code: each rank's set, append and wait, then one multi_get (now)
    or W gets (before); rank 0's deletes of exchange n - 2's W + 1 keys from the third exchange on."""
    reads = 1 if method == "through-one-read" else world
    return world * (3 + reads) * exchanges + (world + 1) * max(0, exchanges - 2)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", default="64,256,1024")
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--exchanges", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch.distributed as dist
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=600), wait_for_workers=False)
    port = server.port
    methods = args.methods.split(",")
    table = {}
    start = 0
    for world in (int(w) for w in args.world.split(",")):
        times = {m: [] for m in methods}
        for _ in range(args.repeat):
            for m in methods:  # interleaved
                start += 1
                seconds, ok = run(m, port, world, args.procs, args.exchanges, start, server)
                assert ok, f"{m} at W={world}: a rank got other values"
                times[m].append(seconds)
        table[world] = {m: {"seconds": times[m], "median": statistics.median(times[m]),
                            "requests": requests(m, world, args.exchanges)} for m in methods}
        base = table[world].get("every-rank-reads-all", {}).get("median")
        for m in methods:
            row = table[world][m]
            ratio = f"  {base / row['median']:.1f}x" if base and m != "every-rank-reads-all" else ""
            print(f"W={world:5d} {m:22s} {row['median']:8.3f} s for {args.exchanges} exchanges "
                  f"({', '.join(f'{s:.3f}' for s in row['seconds'])}), {row['requests']} store requests{ratio}",
                  flush=True)
        if args.out:  # after each world size: a run cut short keeps the sizes it finished
            with open(args.out, "w") as f:
                json.dump({"procs": args.procs, "exchanges": args.exchanges, "repeat": args.repeat,
                           "cpus": os.cpu_count(), "worlds": table}, f, indent=1)


if __name__ == "__main__":
    main()
