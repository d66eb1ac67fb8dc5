"""One rank of test_agree_faults: `python agree_faults_worker.py MODE ROOT OUT` with torchrun's variables,
ROOT holding the tiny llama checkpoint (save_pretrained).

MODE is ACTION-WHO-NTH: every rank calls shardcast.from_pretrained(stream_beside_build=True, timeout=TIMEOUT),
and rank WHO, on entering from_pretrained's NTH store exchange (`_stream_rules.agree`: "first", before the
build; "second", after planning its part of the stream), waits until every other rank has entered that
exchange too and then
  freeze: stops itself (SIGSTOP; the test kills it once the others are done),
  kill:   kills itself (SIGKILL: no exit handler, no goodbye on its sockets).
Every rank first writes OUT.entered.RANK on entering that exchange, so the test sees where the fault hit.
The others each write what from_pretrained raised and how long after entering the exchange it did; rank
0, which serves the store, stays until the others wrote theirs; then every rank leaves at once (os._exit:
no teardown of a group whose peer is frozen or dead).
"""
import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import shardcast
from shardcast import _stream_rules

TIMEOUT = 6.0  # from_pretrained's timeout= (seconds): the exchanges' deadline
WAIT_FOR_PEERS_S = 90.0  # how long the faulted rank waits for the others to enter the exchange


def marker(out, rank):
    return f"{out}.entered.{rank}"


def wait_for(paths, seconds):
    deadline = time.monotonic() + seconds
    while not all(os.path.exists(p) for p in paths) and time.monotonic() < deadline:
        time.sleep(0.05)


def fault(action):
    if action == "freeze":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        raise ValueError(f"unknown fault {action!r}")


def with_fault(action, who, nth, out, rank, world, entered):
    """_stream_rules.agree as from_pretrained calls it, with rank `who` faulted as it enters call `nth`."""
    real = _stream_rules.agree
    calls = [0]

    def agree(*args, **kwargs):
        calls[0] += 1
        if calls[0] == nth:
            entered.append(time.monotonic())
            open(marker(out, rank), "w").close()
            if rank == who:
                wait_for([marker(out, r) for r in range(world) if r != who], WAIT_FOR_PEERS_S)
                fault(action)
        return real(*args, **kwargs)
    return agree


def main():
    mode, root, out = sys.argv[1:4]
    action, who, nth = mode.split("-")
    who, nth = int(who), {"first": 1, "second": 2}[nth]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # transformers' imports and the config's read before the group's barrier, not after it: from there to
    # the first exchange is then a fraction of a second of work, so the ranks that are not faulted enter it
    # well within TIMEOUT of each other (one later than that would be named absent beside the faulted one).
    from transformers import AutoConfig
    AutoConfig.from_pretrained(os.path.join(root, "llama"))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    entered = []
    _stream_rules.agree = with_fault(action, who, nth, out, rank, world, entered)
    error = None
    try:
        shardcast.from_pretrained(os.path.join(root, "llama"), dtype=torch.bfloat16, timeout=TIMEOUT,
                                  stream_beside_build=True)
    except Exception as e:  # noqa: BLE001 -- what each rank raised is the result; the test judges its type
        error = {"class": type(e).__name__, "shardcast": isinstance(e, shardcast.ShardcastError),
                 "message": str(e), "absent_ranks": getattr(e, "absent_ranks", None),
                 "store_stalled": getattr(e, "store_stalled", None)}
    ended = time.monotonic()
    result = {"error": error, "seconds": ended - entered[0] if entered else None}
    tmp = f"{out}.{rank}.partial"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, f"{out}.{rank}")
    if rank == 0:  # it serves the store: it stays until the others are done with it
        wait_for([f"{out}.{r}" for r in range(1, world) if r != who], 60)
    os._exit(0)


if __name__ == "__main__":
    main()
