"""One rank of test_fail_together.py: `python fail_together_worker.py MODE ROOT OUT` with torchrun's variables.

MODE options: world 3. Each scenario is a load, save or from_pretrained that fails on ONE rank only,
before the ranks agree (a bad SHARDCAST_TARGET, a bad chunk_bytes, a wrongly typed option, a bad
explicit mapping), on rank 0 in some scenarios and on rank 2 in others. Every call runs with a
collective timeout of 600 s, so a rank left waiting for the failed one would take minutes. Each
rank records, per scenario, the exception's class and message and how long the call took; a load
that succeeds on every rank closes the run (the per-group exchange and operation counters are still
in step after all the failures).
MODE pretrained: the same for from_pretrained. MODE absent: two ranks fail while the third never comes (run
last). MODE scenarios: several modes in turn (ranks.each_scenario).
"""
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

import ranks
import shardcast

TIMEOUT = 600.0  # seconds per collective: a rank left waiting would show as minutes, not seconds
ABSENT_TIMEOUT = 3  # seconds: MODE absent's calls, which wait that long for the rank that never comes


def rows(n, world, rank):  # FSDP2's dim-0 rule, written out independently
    chunk = -(-n // world)
    begin = min(n, rank * chunk)
    return begin, min(n, begin + chunk)


class _Env:
    """SHARDCAST_* variables set on this rank only, for one call."""

    def __init__(self, **values):
        self.values, self.saved = values, {}

    def __enter__(self):
        for k, v in self.values.items():
            self.saved[k] = os.environ.get(k)
            os.environ[k] = v

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def options(root, rank, world):
    from safetensors.torch import load_file
    path = os.path.join(root, "model.safetensors")
    ref = load_file(path)
    b, e = rows(ref["w"].shape[0], world, rank)

    def linear():  # a plain module (replicated parameters): every rank receives every tensor
        torch.manual_seed(0)
        m = torch.nn.Linear(ref["linear.weight"].shape[1], ref["linear.weight"].shape[0])
        return torch.nn.ModuleDict({"linear": m})

    def mapping():
        return {"w": (torch.empty(e - b, ref["w"].shape[1]), b, e)}

    def bad_mapping():  # a value that is not (tensor, rows...) on the failing rank
        return {"w": ([0.0] * 3, b, e)}

    def bad_rows():  # rows given as text
        return {"w": (torch.empty(e - b, ref["w"].shape[1]), str(b), e)}

    class Opaque:
        pass

    cases = [
        # (name, failing rank, call(failing) -> runs the operation; `failing` says whether this rank fails)
        ("load: SHARDCAST_TARGET=gpu", 0,
         lambda f: _with_env(f, SHARDCAST_TARGET="gpu")(lambda: shardcast.load(linear(), root, timeout=TIMEOUT))),
        ("load: SHARDCAST_TARGET=gpu", 2,
         lambda f: _with_env(f, SHARDCAST_TARGET="gpu")(lambda: shardcast.load(linear(), root, timeout=TIMEOUT))),
        ("load mapping: SHARDCAST_TARGET=gpu", 2,
         lambda f: _with_env(f, SHARDCAST_TARGET="gpu")(lambda: shardcast.load(mapping(), path, timeout=TIMEOUT))),
        ("load: chunk_bytes=1", 0,
         lambda f: shardcast.load(linear(), root, chunk_bytes=1 if f else None, timeout=TIMEOUT)),
        ("load mapping: chunk_bytes='lots'", 2,
         lambda f: shardcast.load(mapping(), path, chunk_bytes="lots" if f else None, timeout=TIMEOUT)),
        ("load: staging_slots='x'", 2,
         lambda f: shardcast.load(linear(), root, staging_slots="x" if f else None, timeout=TIMEOUT)),
        ("load mapping: staging_slots=object", 0,
         lambda f: shardcast.load(mapping(), path, staging_slots=Opaque() if f else None, timeout=TIMEOUT)),
        ("load: timeout='soon'", 2,
         lambda f: shardcast.load(linear(), root, timeout="soon" if f else TIMEOUT)),
        ("load mapping: a list for a tensor", 0,
         lambda f: shardcast.load(bad_mapping() if f else mapping(), path, timeout=TIMEOUT)),
        ("load mapping: a list for a tensor", 2,
         lambda f: shardcast.load(bad_mapping() if f else mapping(), path, timeout=TIMEOUT)),
        ("load mapping: rows as text", 2,
         lambda f: shardcast.load(bad_rows() if f else mapping(), path, timeout=TIMEOUT)),
        ("save: chunk_bytes=1", 0,
         lambda f: shardcast.save(linear(), os.path.join(os.path.dirname(sys.argv[3]), "saved"), overwrite=True,
                                  chunk_bytes=1 if f else None, timeout=TIMEOUT)),
        ("save: staging_slots=object", 2,
         lambda f: shardcast.save(linear(), os.path.join(os.path.dirname(sys.argv[3]), "saved"), overwrite=True,
                                  staging_slots=Opaque() if f else None, timeout=TIMEOUT)),
    ]
    out = []
    for name, failing, call in cases:
        out.append(_run(name, failing, rank, lambda: call(rank == failing)))
    # Every counter still in step: a load that succeeds on every rank.
    local = mapping()["w"][0]
    shardcast.load({"w": (local, b, e)}, path, timeout=TIMEOUT)
    return {"cases": out, "after": torch.equal(local, ref["w"][b:e])}


def pretrained(root, rank, world):
    """from_pretrained failing on one rank before its load: a bad SHARDCAST_TARGET (rank 2), a checkpoint
    this rank cannot see (rank 0), a dtype that is not one (rank 1), a keyword load does not take (rank 2),
    and where torch sees no GPU, SHARDCAST_TARGET=cuda (rank 1)."""
    no_gpu = [] if torch.cuda.is_available() else [
        ("from_pretrained: SHARDCAST_TARGET=cuda, no GPU", 1,
         lambda f: _with_env(f, SHARDCAST_TARGET="cuda")(
             lambda: shardcast.from_pretrained(os.path.join(root, "llama"), dtype=torch.float32, timeout=TIMEOUT)))]
    cases = [
        ("from_pretrained: SHARDCAST_TARGET=gpu", 2,
         lambda f: _with_env(f, SHARDCAST_TARGET="gpu")(
             lambda: shardcast.from_pretrained(os.path.join(root, "llama"), dtype=torch.float32, timeout=TIMEOUT))),
        ("from_pretrained: a path this rank lacks", 0,
         lambda f: shardcast.from_pretrained(os.path.join(root, "llama" + ("-missing" if f else "")),
                                             dtype=torch.float32, timeout=TIMEOUT)),
        ("from_pretrained: a dtype that is not one", 1,
         lambda f: shardcast.from_pretrained(os.path.join(root, "llama"), dtype="float16" if f else torch.float32,
                                             timeout=TIMEOUT)),
        ("from_pretrained: a keyword load does not take", 2,
         lambda f: shardcast.from_pretrained(os.path.join(root, "llama"), dtype=torch.float32, timeout=TIMEOUT,
                                             **({"strict_key": True} if f else {}))),
    ] + no_gpu
    # Whether a rank built a model in a call that failed: the first exchange names the failed rank, so none
    # should (each once imported the modeling code and built the model, to fail at the load's verdict).
    from shardcast import _pretrained
    built = []
    build = _pretrained._build_meta

    def counted(*args, **kwargs):
        built.append(1)
        return build(*args, **kwargs)
    _pretrained._build_meta = counted
    out = []
    for name, failing, call in cases:
        before = len(built)
        out.append({**_run(name, failing, rank, lambda: call(rank == failing)), "built": len(built) - before})
    _pretrained._build_meta = build
    model = shardcast.from_pretrained(os.path.join(root, "llama"), dtype=torch.float32, timeout=TIMEOUT)
    return {"cases": out, "after": model.shardcast_report["world_size"] == world}


def absent(root, rank, world):
    """Ranks 0 and 1 fail before their load (a bad SHARDCAST_TARGET) while rank 2 never comes (it stays alive
    and joins no collective until they are done: a rank that exited would end their waits at once). Both
    load, then save, with timeout=ABSENT_TIMEOUT, and each must end within it: a failed rank's handshake
    once had the default 600 s, and with no rank there that had not failed, nothing ended it sooner. Run
    last: rank 2's missing exchanges leave the counters out of step."""
    done = os.path.join(root, "absent-done.{}")
    if rank == 2:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not all(os.path.exists(done.format(r)) for r in (0, 1)):
            time.sleep(0.2)
        return {"cases": []}

    def linear():
        return torch.nn.ModuleDict({"linear": torch.nn.Linear(4, 3)})

    class Opaque:
        pass

    saved = os.path.join(os.path.dirname(sys.argv[3]), "saved-absent")
    wait = ABSENT_TIMEOUT
    out = [_run("load: SHARDCAST_TARGET=gpu, rank 2 absent", rank, rank,
                lambda: _with_env(True, SHARDCAST_TARGET="gpu")(lambda: shardcast.load(linear(), root, timeout=wait))),
           _run("save: staging_slots=object, rank 2 absent", rank, rank,
                lambda: shardcast.save(linear(), saved, overwrite=True, staging_slots=Opaque(), timeout=wait))]
    with open(done.format(rank), "w"):
        pass
    return {"cases": out}


def _with_env(failing, **values):
    def run(call):
        if not failing:
            return call()
        with _Env(**values):
            return call()
    return run


def _run(name, failing, rank, call):
    t0 = time.monotonic()
    try:
        call()
        error = None
    except Exception as e:  # noqa: BLE001 -- the test compares what every rank raised
        error = {"class": type(e).__name__, "message": str(e)}
    return {"name": name, "failing": failing, "error": error, "seconds": time.monotonic() - t0}


def main():
    mode, root, out = sys.argv[1:4]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT))
    try:
        modes = {"options": options, "pretrained": pretrained, "absent": absent}
        ranks.each_scenario(mode, root, lambda name, where: modes[name](where, rank, world), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
