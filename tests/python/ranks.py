"""Real ranks for the Python tests: a worker script run as N processes with torchrun's variables, each
writing a JSON result. Every process has a deadline; nothing is left running.

Starting a rank costs seconds (it imports torch, often transformers), so a test file runs the scenarios
that share a world size in one launch (`Scenarios`): the worker runs each in turn (`each_scenario`), a
scenario that raises is recorded and the next one still runs, and each test reads its own scenario's
results. Scenarios that kill or freeze a rank keep launches of their own (`run`). And the ranks are forked
by servers that imported torch and transformers once (forked.py), not started as fresh interpreters: on
CI's two cores the imports were most of a launch's start-up. fork=False (a launch that measures memory)
or SHARDCAST_TEST_FORK=0 (every launch) starts fresh interpreters."""
import fcntl
import json
import os
import random
import socket
import subprocess
import tempfile
import traceback

from forked import start

HERE = os.path.dirname(os.path.abspath(__file__))


class PortTaken(Exception):
    pass


_ports = {}  # port -> the lock that keeps it this process's, for its life (a port serves one launch)


def free_port():
    """A port for rank 0's store, free now, below the kernel's ephemeral range: a port the kernel hands out
    (bind to 0) can become any connection's own end (Gloo's pairs, a store client) before rank 0 binds it,
    and the others then wait for a store that is not there until their rendezvous timeout. Below the range,
    a lock file a port (flock, released when this process ends) keeps two test processes from picking the
    same one; anything else that takes it is EADDRINUSE on rank 0 (PortTaken: run again)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    first = max(1024, low - 12000)
    locks = os.path.join(tempfile.gettempdir(), "shardcast-test-ports")
    os.makedirs(locks, exist_ok=True)
    rng = random.Random()  # seeded afresh: not the sequence of a test that seeded the module's
    for _ in range(100 if first < low else 0):
        port = rng.randrange(first, low)
        if port in _ports:
            continue
        lock = open(os.path.join(locks, str(port)), "a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with socket.socket() as s:
                s.bind(("", port))
        except OSError:
            lock.close()
            continue
        _ports[port] = lock
        return port
    with socket.socket() as s:  # no room below the range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(script, mode, root, world, tmp_path, env=None, timeout=300, allow_fail=False, rank_env=None, faulted=(),
        fork=True):
    """Runs `python script mode root out` as `world` ranks (rank_env(r): variables for rank r only;
    faulted: ranks a test kills or freezes, waited for last and killed if still running);
    returns each rank's JSON result (or, with
    allow_fail, None for a rank that wrote none). init_process_group binds the port itself, so a port
    taken by a concurrent test between choosing and binding starts the run over."""
    for attempt in range(3):
        try:
            return _run_once(script, mode, root, world, tmp_path, env or {}, timeout, allow_fail, rank_env, faulted,
                             fork)
        except PortTaken:
            if attempt == 2:
                raise


def _run_once(script, mode, root, world, tmp_path, env, timeout, allow_fail, rank_env, faulted, fork):
    port, out = free_port(), tmp_path / f"{mode}-{world}"
    codes, logs = _launch(script, mode, root, world, out, port, env, timeout, rank_env, faulted, fork)
    results = []
    for r in range(world):
        path = tmp_path / f"{mode}-{world}.{r}"
        if not allow_fail:
            assert codes[r] == 0, f"rank {r} failed:\n{logs[r][-3000:]}"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return results


def _launch(script, mode, root, world, out, port, env, timeout, rank_env, faulted, fork=True):
    """Runs the ranks to their end: (exit codes, logs). Raises subprocess.TimeoutExpired when a rank not
    in `faulted` outlives the timeout, PortTaken when the port went to someone else."""
    # SHARDCAST_FAULT acts only in tests. SHARDCAST_STREAM_BESIDE_BUILD=1: from_pretrained streams beside the
    # build (its riskier path) even where it would not by default, with fewer than two cores a rank, as on
    # CI's two cores; test_pretrained_stream sets it empty to test that default.
    base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                TORCH_CPP_LOG_LEVEL="ERROR", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
                SHARDCAST_TEST_FAULTS="1", SHARDCAST_STREAM_BESIDE_BUILD="1", **env)
    if base.get("PYTHONPATH"):  # the ranks run elsewhere than this process: a relative entry would not resolve
        base["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) if p else p
                                             for p in base["PYTHONPATH"].split(os.pathsep))
    envs = [{**base, "RANK": str(r), "LOCAL_RANK": str(r), **(rank_env(r) if rank_env else {})} for r in range(world)]
    procs = start(os.path.join(HERE, script), [mode, str(root), str(out)], envs, fork=fork)
    # The survivors first; a faulted rank (killed or frozen on purpose) is given a moment once they are
    # done, then killed: a frozen one never exits by itself, so one found stopped (SIGSTOP) gets no moment.
    logs = [""] * world
    order = [r for r in range(world) if r not in faulted] + list(faulted)
    try:
        for r in order:
            try:
                moment = 0 if r in faulted and _stopped(procs[r].pid) else 2
                logs[r] = procs[r].communicate(timeout=moment if r in faulted else timeout)[0]
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
    return [p.returncode for p in procs], logs


def _stopped(pid):
    """Whether process `pid` is stopped (SIGSTOP: state T in /proc/PID/stat); False where it cannot tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


# ---- several scenarios in one launch ------------------------------------------------------------------

SCENARIOS = "scenarios"  # the MODE argument of a launch of several scenarios
SCENARIOS_VAR = "SHARDCAST_TEST_SCENARIOS"  # their list (name, root, variables), in each rank's env


class Scenarios:
    """The scenarios of one test file, one launch per world size, made when a test first asks for one of
    them and shared by the file's tests:

        launches = Scenarios("fsdp2_worker.py", tmp_path_factory, {3: ["mapping", "mismatch"], 4: ["flow"]},
                             root=checkpoints)
        per_rank = launches("mismatch", 3)   # [rank 0's result, rank 1's, ...]

    A scenario is a name (the worker's mode, run on `root`), a (name, root) pair, or a (name, root, env)
    triple whose variables are set for that scenario only (env may also be a function of the rank: rank ->
    its variables, for launcher variables that differ by rank, as HSDP's LOCAL_RANK and GROUP_RANK). A name
    may carry a label after a colon ("native:rank0"), which keeps two runs of one mode apart; the worker sees
    the mode. A scenario that raised on a rank, or that a rank never reached (it died, or the launch ran past
    its timeout), fails the test that asks for it, naming the scenario and the rank, with the traceback or
    the rank's log; the others keep their results."""

    def __init__(self, script, tmp_path_factory, by_world, root=None, timeout=600, env=None, rank_env=None,
                 fork=True):
        self.script, self.tmp, self.root, self.timeout = script, tmp_path_factory, root, timeout
        self.env, self.rank_env, self.fork = env or {}, rank_env, fork
        self.by_world = {w: [(s, root, {}) if isinstance(s, str) else (tuple(s) + ({},))[:3] for s in names]
                         for w, names in by_world.items()}
        self.launched = {}

    def __call__(self, name, world):
        if world not in self.launched:
            self.launched[world] = self._launch(world)
        results, why = self.launched[world]
        out = []
        for rank, r in enumerate(results):
            if r is None or name not in r:
                raise AssertionError(f"scenario {name!r} (world size {world}): rank {rank} never finished it; {why[rank]}")
            if "raised" in r[name]:
                raise AssertionError(f"scenario {name!r} (world size {world}) raised on rank {rank}:\n{r[name]['raised']}")
            out.append(r[name]["result"])
        return out

    def _launch(self, world):
        scenarios = self.by_world[world]
        assert len({n for n, _, _ in scenarios}) == len(scenarios), scenarios
        tmp = self.tmp.mktemp(f"{os.path.splitext(self.script)[0]}-w{world}")

        def rank_env(rank):  # the scenarios' list, each scenario's variables as this rank sees them
            listed = [[n, str(r), e(rank) if callable(e) else e] for n, r, e in scenarios]
            return {**(self.rank_env(rank) if self.rank_env else {}), SCENARIOS_VAR: json.dumps(listed)}
        for attempt in range(3):
            try:
                codes, logs = _launch(self.script, SCENARIOS, scenarios[0][1], world, tmp / "out", free_port(),
                                      self.env, self.timeout, rank_env, (), self.fork)
                break
            except PortTaken:
                if attempt == 2:
                    raise
            except subprocess.TimeoutExpired:
                codes, logs = [None] * world, [f"the launch ran past its {self.timeout} s"] * world
                break
        results, why = [], []
        for r in range(world):
            path = tmp / f"out.{r}"
            results.append(json.loads(path.read_text()) if path.exists() else None)
            why.append(logs[r] if codes[r] is None else f"it exited with {codes[r]}, its log ends:\n{logs[r][-3000:]}")
        return results, why


def python_out(code, *args, timeout=240):
    """The last line a fresh `python -c code args...` prints (one thread a rank's worth of torch), after
    it ended well: for what needs a process of its own (a world of one, accelerate's state)."""
    import sys
    done = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""


def shardcast_error(call, key="type"):
    """What a worker reports of a failure every rank must share: {key: the class name of the ShardcastError
    `call` raised (None if it raised none), "message": its text}. Any other exception propagates."""
    import shardcast
    try:
        call()
    except shardcast.ShardcastError as e:
        return {key: type(e).__name__, "message": str(e)}
    return {key: None}


def each_scenario(mode, root, call, out_file):
    """The worker's side: for MODE `scenarios`, runs call(mode, root) for each scenario the launch lists,
    in order, with its variables set, and writes {name: {"result": ...} or {"raised": traceback}} to out_file after each (a rank
    that dies leaves what it finished). Otherwise runs call(MODE, ROOT) alone, writes and returns its
    result, as a launch of one mode always did. Returns what it wrote."""
    if mode != SCENARIOS:
        result = call(mode, root)
        _write(out_file, result)
        return result
    done = {}
    for name, scenario_root, env in json.loads(os.environ[SCENARIOS_VAR]):
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            done[name] = {"result": call(name.split(":")[0], scenario_root)}
        except Exception:  # noqa: BLE001  (recorded for the test that reads it; the next scenario runs)
            done[name] = {"raised": traceback.format_exc()}
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k)
                else:
                    os.environ[k] = v
        _write(out_file, done)
    return done


def _write(path, result):
    tmp = f"{path}.partial"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)  # whole or absent: a reader never sees half a file
