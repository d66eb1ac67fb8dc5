#!/usr/bin/env python3
"""The store exchanges every from_pretrained makes (whether each rank can stream, whether every plan came out,
every rank's phases), at W ranks, three ways over one real c10d TCPStore:

    rank0-decides         `shardcast._decided.decided`, as `_stream_rules.agree` now makes its exchange: each
                          rank sets its value, rank 0 reads all W in one multi_get, decides
                          (`_stream_rules.decide`, the real function) and sets the common answer and each
                          node's part in one multi_set; every other rank reads its two: W + 2 (W - 1) values
    through-one-read      `shardcast._exchange.gathered` (each rank waits for all W keys and reads them in one
                          multi_get: 4 requests a rank, W^2 values), as agree made it before
    every-rank-reads-all  the same but one get a key (W + 3 requests a rank), the code before that, kept here

W ranks are W threads, spread over --procs processes, each with its own TCPStore client (its own socket), as
W processes would have; the store's server runs in the parent process, which only waits. The value is a
from_pretrained first-exchange answer (a reason, whether the cores decide, a hostname, a boot id, a 64-CPU
mask, a CPU cgroup and its quota), 8 ranks a node. Each method makes --exchanges exchanges in a row; the
time is from the moment every rank is told to go (after a barrier) to the end of the last rank's last
exchange, and the median of --repeat interleaved runs is printed with the store requests and the values
read it makes (from the code, not counted). Where a rank gathers every value, the decision each rank then
made from them (agree's, before) is left out of the time (made after it, for the check): the baselines'
times are their store traffic and parsing alone. Every rank checks it got the decision for its node that
`decide` makes from every rank's value.

--methods store-floor adds what the harness itself costs for an exchange's shape (each rank sets its value,
rank 0 waits for all W and sets one key, which the others wait for and read), to read the others against.

    bench/bench_exchange.py [--world 64,256,1024] [--procs 8] [--exchanges 3] [--repeat 3] [--methods ...]
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

METHODS = ("rank0-decides", "through-one-read", "every-rank-reads-all")
# Not a way to exchange: what this harness costs at W for an exchange's shape alone (each rank sets its
# value; rank 0 waits for all W keys, reads none and sets one key; the others wait for it and read it).
FLOOR = "store-floor"


def floor(ch, rank, world, value, timeout_s):
    from shardcast._exchange import _key, _left, _next, _through_store
    n = _next(ch)
    deadline = time.monotonic() + timeout_s

    def exchange(store):
        store.set(_key(n, rank), json.dumps(value))
        if rank == 0:
            store.wait([_key(n, r) for r in range(world)], _left(deadline))
            store.set(_key(n, "="), "1")
        else:
            store.wait([_key(n, "=")], _left(deadline))
            store.get(_key(n, "="))

    return _through_store(ch, exchange, timeout_s, "floor")


def answer(rank):
    """Rank `rank`'s first-exchange answer, as `_stream_rules.agree` sends it."""
    return [None, True, f"node{rank // 8}", f"boot-{rank // 8:04d}-4c1f-9a2e", format((1 << 64) - 1, "x"),
            "4026531835", None, None]  # ..., the cgroup, its quota, not failed already


def every_rank_reads_all(ch, rank, world, value, timeout_s):
    """The baseline: gathered as it was before (git show 009718e:python/shardcast/_exchange.py), the same
    calls through the same deadline machinery, but for its reads: W gets, one per key."""
    from shardcast._exchange import _key, _left, _next, _through_store
    n = _next(ch)
    keys = [_key(n, r) for r in range(world)]
    deadline = time.monotonic() + timeout_s

    def exchange(store):
        if rank == 0 and n >= 2:  # its rank 0 dropped exchange n - 2 as it began n
            for r in [*range(world), "who"]:
                store.delete_key(_key(n - 2, r))
        store.set(_key(n, rank), json.dumps(value))
        store.append(_key(n, "who"), f"{rank} ")
        store.wait(keys, _left(deadline))
        return [json.loads(store.get(k)) for k in keys]

    return _through_store(ch, exchange, timeout_s, "baseline", who=(_key(n, "who"), world))


def rank_thread(method, port, rank, world, exchanges, start, out):
    import torch.distributed as dist
    from shardcast._decided import decided
    from shardcast._exchange import gathered
    from shardcast._stream_rules import decide
    store = dist.TCPStore("127.0.0.1", port, world + 1, False, timeout=timedelta(seconds=600))
    prefix = dist.PrefixStore(f"{method}/{start}", store)
    ch = (prefix, f"bench-{method}-{start}-{rank}", "127.0.0.1", {})  # a channel per rank: its own count
    part = f"node {answer(rank)[3]}"
    store.add(f"{method}/{start}/ready", 1)
    store.wait([f"{method}/{start}/go"], timedelta(seconds=600))
    got = []
    for _ in range(exchanges):
        if method == FLOOR:
            floor(ch, rank, world, answer(rank), 600.0)
        elif method == "rank0-decides":
            got.append(decided(ch, rank, world, answer(rank), decide, 600.0, "bench", part=part))
        elif method == "through-one-read":
            got.append(gathered(ch, rank, world, answer(rank), 600.0))
        else:
            got.append(every_rank_reads_all(ch, rank, world, answer(rank), 600.0))
    end = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process on this host
    if method == FLOOR:
        out.append((end, True))
        return
    if method != "rank0-decides":  # the decision each rank made from every value: after the time, for the check
        got = [(d[""], d[part]) for d in (decide(every) for every in got)]
    want = decide([answer(r) for r in range(world)])
    out.append((end, all(g == (want[""], want[part]) for g in got)))


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
    """(store requests, values read) a run makes, from the code. Requests: each rank's set, append and
    wait, then one multi_get (gathered) or W gets (before), or, rank0-decides, rank 0's multi_get,
    multi_set, compare_set and add and the others' get, check and get; rank 0's deletes of the exchange
    before (W + 1 keys, and the answers: 2 + W / 8 nodes) from the second exchange on (the baseline's: of
    exchange n - 2, from the third on)."""
    nodes = -(-world // 8)
    if method == FLOOR:
        return (world * 2 + 1 + (world - 1)) * exchanges, (world - 1) * exchanges
    if method == "rank0-decides":
        each = world * 3 + 4 + (world - 1) * 3  # rank 0: multi_get, multi_set, compare_set, add; others: 3
        values = world + 2 * (world - 1)
        forget = world + 1 + 2 + nodes
    else:
        each = world * (3 + (1 if method == "through-one-read" else world))
        values = world * world
        forget = world + 1
    dropping = max(0, exchanges - (2 if method == "every-rank-reads-all" else 1))  # the old rule: n - 2 at n
    return each * exchanges + forget * dropping, values * exchanges


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
                            "requests": requests(m, world, args.exchanges)[0],
                            "values_read": requests(m, world, args.exchanges)[1]} for m in methods}
        for m in methods:
            row = table[world][m]
            ratios = "".join(f"  {table[world][b]['median'] / row['median']:.1f}x {b}"
                             for b in methods[methods.index(m) + 1:] if FLOOR not in (m, b))
            print(f"W={world:5d} {m:22s} {row['median']:8.3f} s for {args.exchanges} exchanges "
                  f"({', '.join(f'{s:.3f}' for s in row['seconds'])}), {row['requests']} store requests, "
                  f"{row['values_read']} values read{ratios}", flush=True)
        if args.out:  # after each world size: a run cut short keeps the sizes it finished
            with open(args.out, "w") as f:
                json.dump({"procs": args.procs, "exchanges": args.exchanges, "repeat": args.repeat,
                           "cpus": os.cpu_count(), "worlds": table}, f, indent=1)


if __name__ == "__main__":
    main()
