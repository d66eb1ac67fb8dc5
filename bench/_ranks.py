"""The benchmarks' rank launcher: a benchmark script run again as W worker processes on this machine, with
torchrun's variables, each writing its result as JSON; bench_peers.py, bench_save.py and
bench_layout_sources.py use it, and bench_gpu_load.py its free_port.

Each rank runs `python SCRIPT --worker ARGS...` with MASTER_ADDR/MASTER_PORT (a free local port), WORLD_SIZE,
RANK and LOCAL_RANK set, the build's python package ($SHARDCAST_BUILD_DIR/python, default build/python) on
PYTHONPATH, one OpenMP thread, and torch's C++ log and Python's warnings quiet. Rank r writes its JSON result to f"{results}.{r}".
"""
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script, worker_args, world, results, what, timeout_s, env=None, rank_env=None):
    """Runs `world` ranks of `script --worker *worker_args` and returns each rank's JSON result, in rank order.

    what: names the run in a failure's message. timeout_s: how long the ranks together may take.
    env: more variables for every rank; rank_env(r): more for rank r alone.
    A rank that fails ends the others (they would wait in a collective until their own timeout), and so does
    the deadline; either exits with a message naming the ranks that failed."""
    base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
                PYTHONPATH=str(pathlib.Path(os.environ.get("SHARDCAST_BUILD_DIR", ROOT / "build")) / "python"), TORCH_CPP_LOG_LEVEL="ERROR", PYTHONWARNINGS="ignore",
                OMP_NUM_THREADS="1", **(env or {}))
    procs = [subprocess.Popen([sys.executable, str(script), "--worker", *map(str, worker_args)],
                              env=dict(base, RANK=str(r), LOCAL_RANK=str(r), **(rank_env(r) if rank_env else {})))
             for r in range(world)]
    try:
        deadline = time.monotonic() + timeout_s
        while None in (codes := [p.poll() for p in procs]) and time.monotonic() < deadline:
            if failed := [r for r, code in enumerate(codes) if code not in (None, 0)]:
                raise SystemExit(f"{what}: rank(s) {failed} failed")
            time.sleep(0.2)
        if failed := [r for r, code in enumerate(codes) if code != 0]:
            raise SystemExit(f"{what}: rank(s) {failed} failed or ran past {timeout_s} s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [json.loads(pathlib.Path(f"{results}.{r}").read_text()) for r in range(world)]
