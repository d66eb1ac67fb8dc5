"""Ranks of a store exchange on threads of one test process, each with a TCPStore client of its own on one
real server (as processes would have): the helpers of test_exchange.py and test_exchange_decided.py."""
import datetime
import threading

import torch.distributed as dist


def lone_channel(name):
    """One rank's channel on a store of its own (a world of one)."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
    return store, (store, name, "the test's store", {})


def run_ranks(world, call, timeout_s=60):
    """call(rank, channel) on `world` threads, each with a TCPStore client of its own on one server (as
    processes would have), a channel count per rank; every rank's result, or the first error raised."""
    server = dist.TCPStore("127.0.0.1", 0, world + 1, True, timeout=datetime.timedelta(seconds=30),
                           wait_for_workers=False)
    got, errors = {}, []
    connected = threading.Barrier(world)  # every rank's clock starts once every client is connected

    def rank(r):
        try:
            client = dist.TCPStore("127.0.0.1", server.port, world + 1, False, timeout=datetime.timedelta(seconds=30))
            connected.wait(30)
            got[r] = call(r, (client, f"{call.__name__}-{r}-{server.port}", "the test's store", {}))
        except Exception as e:  # noqa: BLE001 -- raised below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), "a rank did not end"
    if errors:
        raise errors[0]
    return server, [got[r] for r in range(world)]


def each_rank(world, call, timeout_s=60):
    """As run_ranks, but every rank's own outcome: its result, or the exception it raised."""
    def caught(r, ch):
        try:
            return call(r, ch)
        except Exception as e:  # noqa: BLE001 -- the rank's outcome
            return e
    caught.__name__ = call.__name__
    return run_ranks(world, caught, timeout_s)[1]


class ReadsRecorded:
    """A store that records the keys read through it (get, multi_get), for the requests a rank makes."""

    def __init__(self, store, read):
        self._store, self._read = store, read

    def get(self, key):
        self._read.append(key)
        return self._store.get(key)

    def multi_get(self, keys):
        self._read.extend(keys)
        return self._store.multi_get(keys)

    def __getattr__(self, name):
        return getattr(self._store, name)


class WaitReplaced(ReadsRecorded):
    """A store whose wait is another function."""

    def __init__(self, store, wait):
        super().__init__(store, [])
        self.wait = wait
