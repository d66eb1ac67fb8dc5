#!/usr/bin/env python3
"""Read paths from a warm checkpoint file into memory already written: one process, --threads threads
(default 1: the per-core rates), the same bytes through

  pread            os.preadv in 64 MiB calls straight into the destination (shardcast's default reader)
  mmap+copy        an mmap of the file and one user-space copy (numpy.copyto; its page faults included)
  safetensors      safe_open(...).get_slice(key)[rows] then Tensor.copy_ into the destination, key by key
                   (what torch's HuggingFaceStorageReader does per read item; one thread only)
  memcpy           no file: as many bytes copied between two regions of written memory (the machine's
                   copy bound for any reader that lands bytes once)

With --threads T each path splits the bytes into T contiguous parts, one thread each (the calls release the
GIL): with T = the machine's cores, the node's bound for W ranks that share them.

interleaved, --repeat rounds, each with its GB/s; the destination is written before the first round, so
no path pays for fresh pages. Correctness: the destination's CRC32 after every pread and mmap+copy round
must be the same (the safetensors path lands whole tensors in key order, a different arrangement of the
region, and is timed only).

    bench/bench_read_paths.py [--checkpoint out/dcp-llama-16L] [--mib 400] [--threads 1] [--repeat 3] [--out FILE]
"""
import argparse
import json
import mmap
import os
import pathlib
import statistics
import struct
import threading
import time
import zlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default=str(ROOT / "out" / "dcp-llama-16L"))
    ap.add_argument("--mib", type=int, default=400)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", help="default bench/results/read-paths.json (read-paths-tT.json with --threads T)")
    args = ap.parse_args()
    if args.threads < 1:
        ap.error("--threads must be at least 1")
    args.out = args.out or str(ROOT / "bench" / "results" / ("read-paths.json" if args.threads == 1
                                                             else f"read-paths-t{args.threads}.json"))
    import numpy as np
    import torch
    from safetensors import safe_open
    files = sorted(p for p in pathlib.Path(args.checkpoint).iterdir() if p.suffix == ".safetensors")
    if not files:
        raise SystemExit(f"no .safetensors in {args.checkpoint}: run bench/bench_dcp_load.py once to write it")
    path = str(max(files, key=lambda p: p.stat().st_size))
    fd = os.open(path, os.O_RDONLY)
    header = 8 + struct.unpack("<Q", os.pread(fd, 8, 0))[0]
    n = min(args.mib << 20, os.fstat(fd).st_size - header)
    with open(path, "rb") as f:  # warm: every byte through the page cache once
        while f.read(64 << 20):
            pass
    dest = np.ones(n, dtype=np.uint8)  # written: no path pays for fresh pages
    view = memoryview(dest)
    parts = [(n * i // args.threads, n * (i + 1) // args.threads) for i in range(args.threads)]

    def split(part):
        """Runs part(lo, hi) over the T parts, one thread each; returns n."""
        errors = []

        def one(lo, hi):
            try:
                part(lo, hi)
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                errors.append(e)
        threads = [threading.Thread(target=one, args=lh) for lh in parts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return n

    def pread_part(lo, hi):
        off = lo
        while off < hi:
            got = os.preadv(fd, [view[off:min(hi, off + (64 << 20))]], header + off)
            if got <= 0:
                raise SystemExit(f"{path}: short read at {header + off}")
            off += got

    def mmap_copy():
        mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        src = np.frombuffer(mm, dtype=np.uint8, count=n, offset=header)
        split(lambda lo, hi: np.copyto(dest[lo:hi], src[lo:hi]))
        del src
        mm.close()
        return n

    other = np.full(n, 7, dtype=np.uint8)  # memcpy's source: written memory, no file

    tdest = torch.from_numpy(dest)

    def safetensors_slices():
        got = 0
        with safe_open(path, "pt") as st:
            for key in st.keys():
                sl = st.get_slice(key)
                rows = sl.get_shape()[0] if sl.get_shape() else 1
                t = sl[0:rows]
                size = t.numel() * t.element_size()
                if got + size > n:
                    break
                tdest[got:got + size].copy_(t.reshape(-1).view(torch.uint8))
                got += size
        return got

    paths = {"pread": lambda: split(pread_part), "mmap+copy": mmap_copy,
             "memcpy": lambda: split(lambda lo, hi: np.copyto(dest[lo:hi], other[lo:hi]))}
    if args.threads == 1:
        paths["safetensors"] = safetensors_slices
    runs = {k: [] for k in paths}
    crcs = {}
    for _ in range(args.repeat):
        for name, fn in paths.items():
            t = time.perf_counter()
            size = fn()
            runs[name].append({"seconds": time.perf_counter() - t, "bytes": size})
            if name in ("pread", "mmap+copy"):
                crcs.setdefault(name, set()).add(zlib.crc32(view[:n]))
    if len(crcs["pread"] | crcs["mmap+copy"]) != 1:
        raise SystemExit(f"pread and mmap+copy landed different bytes: {crcs}")
    print(f"{path}: {n / 2**20:.0f} MiB from its data region, warm, {args.threads} thread(s), into written memory; "
          f"median of {args.repeat}, interleaved; pread and mmap+copy CRC-identical")
    summary = {}
    for name, rs in runs.items():
        rates = [r["bytes"] / r["seconds"] / 1e9 for r in rs]
        summary[name] = {"median_gb_per_s": statistics.median(rates), "runs": rs}
        print(f"{name:12s} {statistics.median(rates):6.2f} GB/s   rounds: " + ", ".join(f"{x:.2f}" for x in rates))
    pathlib.Path(args.out).write_text(json.dumps({"file": path, "bytes": n, "threads": args.threads, "repeat": args.repeat,
                                                  "paths": summary}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
