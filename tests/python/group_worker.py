"""One rank of test_group.py: `python group_worker.py MODE ROOT OUT` with torchrun's variables set.

MODE subgroup: world 3; ranks 0 and 1 load through a subgroup that has no CPU backend (a backend
registered for cuda only, the shape of an NCCL-only group), twice; rank 2 never calls shardcast and
makes a group with all ranks afterwards (which hangs if the group counters went out of step), and
one world-wide load follows once the subgroup is destroyed.
MODE failure: world 2; rank 1 fails mid-stream (its progress callback raises) in two loads in a row, each
with its own cause, over source rank0 (rank 0 sends, rank 1 receives). Every rank must raise that
load's cause (not the first one's) at once, not after the timeout, and the default group must still
work afterwards (an all_reduce, then a load that succeeds).
MODE kept: world 3; eight loads in a row over the default group and one over a subgroup, each checked
row for row, with the Gloo group each used as agreed in the operation's store ("reuse" or "new"): the
second reuses the first's; after a failed load, a new one; a rank that dropped its group alone (rank 1)
makes every rank make a new one; another timeout makes a new one; a subgroup's load leaves the world's
group kept.
MODE frozen: world 3; one load keeps its group, then rank 2 freezes (SIGSTOP) before the next. Ranks 0 and
1 start that load on the kept group: each must raise the same CommTimeout naming rank 2 within the load's
5 s timeout and a few seconds, never wait on the group's vote or on a frozen peer's socket for good.
MODE frozen0: the same with rank 0 frozen, the rank whose process serves the store: ranks 1 and 2 must
each raise a CommTimeout naming the store's host, within a few timeouts, never hang on the store.
"""
import signal
import time
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

import shardcast


def rows(n, world, rank):  # FSDP2's dim-0 rule, written out independently
    chunk = -(-n // world)
    begin = min(n, rank * chunk)
    return begin, min(n, begin + chunk)


def load_rows(path, ref, group, rank, world):
    b, e = rows(ref.shape[0], world, rank)
    local = torch.empty(e - b, ref.shape[1])
    shardcast.load({"w": (local, b, e)}, path, process_group=group, timeout=20)
    return torch.equal(local, ref[b:e])


def cuda_only_backend(store, rank, size, timeout):
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def subgroup(root, rank, world):
    from safetensors.torch import load_file
    path = os.path.join(root, "model.safetensors")
    ref = load_file(path)["w"]
    dist.Backend.register_backend("cudaonly", cuda_only_backend, devices=["cuda"])
    sub = dist.new_group([0, 1], backend="cudaonly")
    out = {}
    if rank in (0, 1):
        try:
            sub._get_backend(torch.device("cpu"))
            out["sub_has_cpu_backend"] = True
        except Exception:  # noqa: BLE001
            out["sub_has_cpu_backend"] = False
        groups = dict(dist.distributed_c10d._world.pg_names)
        count = dist.distributed_c10d._world.group_count
        out["first"] = load_rows(path, ref, sub, rank, 2)
        out["second"] = load_rows(path, ref, sub, rank, 2)
        out["registry_unchanged"] = (dict(dist.distributed_c10d._world.pg_names) == groups
                                     and dist.distributed_c10d._world.group_count == count)
        dist.destroy_process_group(sub)
    # Every rank makes a group together: its name, from each rank's group counter, must agree, or this
    # hangs until the timeout (the counters of ranks 0 and 1 moved if shardcast made c10d groups).
    everyone = dist.new_group([0, 1, 2], backend="gloo")
    x = torch.ones(1)
    dist.all_reduce(x, group=everyone)
    out["world_group_sum"] = int(x.item())
    out["world"] = load_rows(path, ref, None, rank, world)  # a shardcast call after the subgroup went away
    return out


def failure(root, rank, world):
    from safetensors.torch import load_file
    path = os.path.join(root, "model.safetensors")
    ref = load_file(path)["w"]
    b, e = rows(ref.shape[0], world, rank)
    out = {"loads": []}
    for cause in ("first cause: disk A", "second cause: disk B"):
        def fail_here(done, total):
            if rank == 1:
                raise ValueError(cause)
        t0 = time.monotonic()
        try:
            shardcast.load({"w": (torch.empty(e - b, ref.shape[1]), b, e)}, path, source="rank0", timeout=60,
                           chunk_bytes=4096, progress=fail_here)
            out["loads"].append({"cause": cause, "error": None})
        except shardcast.ShardcastError as err:
            out["loads"].append({"cause": cause, "error": str(err), "seconds": time.monotonic() - t0})
    x = torch.ones(1)
    dist.all_reduce(x)  # the caller's group, after two failed loads
    out["all_reduce"] = int(x.item())
    out["after"] = load_rows(path, ref, None, rank, world)
    return out


def decision_of_last_operation(group=None):
    """The decision the last shardcast operation over `group` agreed on: "reuse" or "new" (read from the
    group's store, where every operation has its own prefix shardcast/op/N; rank 0 drops those of the
    operations before the last two, so the highest N still there is the last)."""
    c10d = dist.distributed_c10d
    store = c10d._get_default_store() if group is None else c10d._world.pg_map[group][1]
    held = [n for n in range(64) if store.check([f"shardcast/op/{n}/group/decision"])]
    return store.get(f"shardcast/op/{held[-1]}/group/decision").decode().split(" ")[0] if held else None


def kept(root, rank, world):
    from safetensors.torch import load_file
    from shardcast import _shardcast
    path = os.path.join(root, "model.safetensors")
    ref = load_file(path)["w"]
    b, e = rows(ref.shape[0], world, rank)
    steps = []

    def load(what, timeout=20, progress=None):
        local = torch.empty(e - b, ref.shape[1])
        try:
            shardcast.load({"w": (local, b, e)}, path, timeout=timeout, chunk_bytes=4096, progress=progress)
            ok, error = torch.equal(local, ref[b:e]), None
        except shardcast.ShardcastError as err:
            ok, error = False, str(err)
        steps.append({"what": what, "ok": ok, "error": error, "group": decision_of_last_operation()})

    def fail_on_rank1(done, total):
        if rank == 1:
            raise ValueError("rank 1 fails mid-stream")

    load("first")
    load("second")
    load("failed", progress=fail_on_rank1)
    load("after the failure")
    load("again")
    if rank == 1:
        _shardcast.forget_gloo_groups()
    load("after rank 1 alone dropped its group")
    load("another timeout", timeout=25)
    sub = dist.new_group([0, 1], backend="gloo")
    if rank in (0, 1):
        sb, se = rows(ref.shape[0], 2, rank)
        local = torch.empty(se - sb, ref.shape[1])
        shardcast.load({"w": (local, sb, se)}, path, process_group=sub, timeout=25)
        steps.append({"what": "subgroup", "ok": torch.equal(local, ref[sb:se]), "error": None,
                      "group": decision_of_last_operation(sub)})
    dist.destroy_process_group(sub)
    load("after the subgroup's", timeout=25)
    return {"steps": steps}


def frozen(root, rank, world, who=2):
    path = os.path.join(root, "model.safetensors")
    from safetensors.torch import load_file
    ref = load_file(path)["w"]
    b, e = rows(ref.shape[0], world, rank)
    local = torch.empty(e - b, ref.shape[1])
    shardcast.load({"w": (local, b, e)}, path, timeout=5)
    first = {"ok": torch.equal(local, ref[b:e]), "group": decision_of_last_operation()}
    dist.barrier()  # every rank read the store before one freezes (rank 0 serves it)
    if rank == who:
        os.kill(os.getpid(), signal.SIGSTOP)  # the test kills it once the others are done
    error, seconds = attempt(path, ref, b, e, timeout=5)
    return {"first": first, "error": error, "seconds": seconds}


def attempt(path, ref, b, e, timeout):
    """(the error of a load of rows [b, e), or None; its seconds)."""
    start = time.monotonic()
    try:
        shardcast.load({"w": (torch.empty(e - b, ref.shape[1]), b, e)}, path, timeout=timeout)
        error = None
    except shardcast.ShardcastError as err:
        error = {"class": type(err).__name__, "message": str(err)}
    return error, time.monotonic() - start


def making(root, rank, world):
    """SHARDCAST_FAULT fails rank 1's making of the operation's Gloo group (an allocation refused): every
    rank's error and seconds under a 60 s timeout, then a second load (the fault acts once) on the group."""
    path = os.path.join(root, "model.safetensors")
    from safetensors.torch import load_file
    ref = load_file(path)["w"]
    b, e = rows(ref.shape[0], world, rank)
    error, seconds = attempt(path, ref, b, e, timeout=60)
    local = torch.empty(e - b, ref.shape[1])
    start = time.monotonic()
    shardcast.load({"w": (local, b, e)}, path, timeout=60)
    return {"error": error, "seconds": seconds, "after": torch.equal(local, ref[b:e]),
            "after_seconds": time.monotonic() - start}


def keys(root, rank, world):
    """The store's key count after each of 6 loads over the default group (rank 0's view)."""
    path = os.path.join(root, "model.safetensors")
    from safetensors.torch import load_file
    ref = load_file(path)["w"]
    store = dist.distributed_c10d._get_default_store()
    counts, ok = [], True
    for _ in range(6):
        ok = load_rows(path, ref, None, rank, world) and ok
        dist.barrier()
        counts.append(store.num_keys())
        # Rank 0 counts while the others wait: a rank past the first barrier began the next load, whose
        # group vote sets keys (up to 3) that rank 0 counted with this load's (CI: [14, 19, 19, 22, 19, 19]).
        dist.barrier()
    return {"counts": counts, "ok": ok}


def main():
    mode, root, out = sys.argv[1:4]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    if mode in ("frozen", "frozen0"):  # no barrier nor teardown with a frozen peer: the result, then out
        result = frozen(root, rank, world, 0 if mode == "frozen0" else 2)
        with open(f"{out}.{rank}", "w") as f:
            json.dump(result, f)
        deadline = time.monotonic() + 30  # rank 0 hosts the store: it stays until rank 1 is done with it
        while rank == 0 and not os.path.exists(f"{out}.1") and time.monotonic() < deadline:
            time.sleep(0.1)
        os._exit(0)
    try:
        result = {"subgroup": subgroup, "failure": failure, "kept": kept, "making": making,
                  "keys": keys}[mode](root, rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
