"""Real ranks for the Python tests: a worker script run as N processes with torchrun's variables, each
writing a JSON result. Every process has a deadline; nothing is left running."""
import json
import os
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


class PortTaken(Exception):
    pass


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(script, mode, root, world, tmp_path, env=None, timeout=300, allow_fail=False, rank_env=None, faulted=()):
    """Runs `python script mode root out` as `world` ranks (rank_env(r): variables for rank r only;
    faulted: ranks a test kills or freezes, waited for last and killed if still running);
    returns each rank's JSON result (or, with
    allow_fail, None for a rank that wrote none). init_process_group binds the port itself, so a port
    taken by a concurrent test between choosing and binding starts the run over."""
    for attempt in range(3):
        try:
            return _run_once(script, mode, root, world, tmp_path, env or {}, timeout, allow_fail, rank_env, faulted)
        except PortTaken:
            if attempt == 2:
                raise


def _run_once(script, mode, root, world, tmp_path, env, timeout, allow_fail, rank_env, faulted):
    port, out = _free_port(), tmp_path / f"{mode}-{world}"
    base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                TORCH_CPP_LOG_LEVEL="ERROR", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
                SHARDCAST_TEST_FAULTS="1", **env)  # SHARDCAST_FAULT acts only in tests
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, script), mode, str(root), str(out)],
                              env={**base, "RANK": str(r), "LOCAL_RANK": str(r), **(rank_env(r) if rank_env else {})},
                              stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    # The survivors first; a faulted rank (killed or frozen on purpose) is given a moment once they are
    # done, then killed: a frozen one never exits by itself.
    logs = [""] * world
    order = [r for r in range(world) if r not in faulted] + list(faulted)
    try:
        for r in order:
            try:
                logs[r] = procs[r].communicate(timeout=2 if r in faulted else timeout)[0]
            except subprocess.TimeoutExpired:
                if r not in faulted:
                    raise
                procs[r].kill()
                logs[r] = procs[r].communicate()[0]
    finally:
        for p in procs:
            p.kill()
    if any("EADDRINUSE" in log for log in logs):
        raise PortTaken()
    results = []
    for r, p in enumerate(procs):
        path = tmp_path / f"{mode}-{world}.{r}"
        if not allow_fail:
            assert p.returncode == 0, f"rank {r} failed:\n{logs[r][-3000:]}"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return results
