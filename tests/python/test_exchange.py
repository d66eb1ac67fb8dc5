"""The exchanges before the handshake (_exchange.py) over a real TCPStore: a rank whose value never comes
is named in the CommTimeout every waiting rank raises."""
import datetime

import pytest
import torch.distributed as dist

from shardcast import _exchange
from shardcast._shardcast import CommTimeout


def _channel(name):
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
    return store, (store, name, "the test's store", {})


# Ranks 0 and 1 of 4 come (rank 1's value and its word are set as gathered would set them); ranks 2
# and 3 never do, so rank 0's wait names exactly them. A channel's first exchange is number 0.
def test_a_gather_names_the_ranks_whose_values_never_came():
    store, ch = _channel("names-missing")
    store.set(_exchange._key(0, 1), "null")
    store.append(_exchange._key(0, "who"), "1 ")
    with pytest.raises(CommTimeout, match=r"did not arrive from ranks 2, 3 \(died, frozen"):
        _exchange.gathered(ch, 0, 4, {"mine": 1}, 1.0)


# Every rank came: the gather returns every value in rank order (the names are only for the timeout).
def test_a_gather_where_every_rank_came_returns_every_value():
    store, ch = _channel("all-came")
    store.set(_exchange._key(0, 1), '"one"')
    assert _exchange.gathered(ch, 0, 2, "zero", 5.0) == ["zero", "one"]


# Rank 1 of 2 waits for rank 0's value, which never comes: rank 1 names rank 0.
def test_a_rank_waiting_for_rank_0_names_it_when_it_never_comes():
    store, ch = _channel("rank0-missing")
    with pytest.raises(CommTimeout, match=r"did not arrive from rank 0 \(died, frozen"):
        _exchange.gathered(ch, 1, 2, "one", 1.0)


def _ranks(world, call, timeout_s=60):
    """call(rank, channel) on `world` threads, each with a TCPStore client of its own on one server (as
    processes would have), a channel count per rank; every rank's result, or the first error raised."""
    import threading
    server = dist.TCPStore("127.0.0.1", 0, world + 1, True, timeout=datetime.timedelta(seconds=30),
                           wait_for_workers=False)
    got, errors = {}, []

    def rank(r):
        try:
            client = dist.TCPStore("127.0.0.1", server.port, world + 1, False, timeout=datetime.timedelta(seconds=30))
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


# Eight ranks make four exchanges in a row: each gets every rank's value in rank order every time; rank 0
# drops exchange n - 2 at n.
def test_eight_ranks_exchange_in_a_row_and_old_exchanges_are_dropped():
    world, rounds = 8, 4

    def four(r, ch):
        return [_exchange.gathered(ch, r, world, {"rank": r, "round": n}, 20.0) for n in range(rounds)]

    server, got = _ranks(world, four)
    for r in range(world):
        assert got[r] == [[{"rank": q, "round": n} for q in range(world)] for n in range(rounds)], r
    for n in (0, 1):  # dropped at 2 and 3
        assert not any(server.check([_exchange._key(n, k)]) for k in (*range(world), "who")), n
    assert all(server.check([_exchange._key(n, k)]) for n in (2, 3) for k in (*range(world), "who"))


# Values of 3 MB from each of four ranks: every rank reads 12 MB, which no single value of the store may
# hold (it refuses a set over 8 MiB): each rank's value stays its own key.
def test_values_that_together_pass_the_store_s_limit_on_one_value_still_reach_every_rank():
    world = 4

    def big(r, ch):
        return _exchange.gathered(ch, r, world, chr(ord("a") + r) * (3 << 20), 30.0)

    _, got = _ranks(world, big)
    for r in range(world):
        assert [len(v) for v in got[r]] == [3 << 20] * world and [v[0] for v in got[r]] == list("abcd"), r
