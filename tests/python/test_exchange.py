"""The exchanges before the handshake (_exchange.py) over a real TCPStore: a rank whose value never comes
is named in the CommTimeout every waiting rank raises."""
import time

import pytest
import torch.distributed as dist

from shardcast import _exchange
from shardcast._shardcast import CommTimeout
from store_ranks import ReadsRecorded, WaitReplaced, each_rank, lone_channel, run_ranks


# Ranks 0 and 1 of 4 come (rank 1's value and its word are set as gathered would set them); ranks 2
# and 3 never do, so rank 0's wait names exactly them. A channel's first exchange is number 0.
def test_a_gather_names_the_ranks_whose_values_never_came():
    store, ch = lone_channel("names-missing")
    store.set(_exchange._key(0, 1), "null")
    store.append(_exchange._key(0, "who"), "1 ")
    with pytest.raises(CommTimeout, match=r"did not arrive from ranks 2, 3 \(died, frozen") as e:
        _exchange.gathered(ch, 0, 4, {"mine": 1}, 1.0)
    assert str(e.value).endswith("within 1 s through the store of the test's store"), str(e.value)


# A store call of the exchange's body that times out while the store answers (its keys never came) is the
# exchange's CommTimeout in the same words on every rank: nothing of the rank's own call (the key it waited
# on, c10d's wait) is in it; c10d's error is chained.
def test_a_store_wait_that_timed_out_is_late_in_words_no_rank_differs_in():
    import datetime
    store, ch = lone_channel("own-wait-timed-out")

    def body(s):
        s.wait([f"never-set-by-rank-{id(s)}"], datetime.timedelta(milliseconds=200))

    with pytest.raises(CommTimeout) as e:
        _exchange._through_store(ch, body, 5.0, "every rank's answer")
    assert str(e.value) == "every rank's answer did not arrive within 5 s through the store of the test's store"
    assert isinstance(e.value.__cause__, (TimeoutError, dist.DistStoreError))


# Every rank came: the gather returns every value in rank order (the names are only for the timeout).
def test_a_gather_where_every_rank_came_returns_every_value():
    store, ch = lone_channel("all-came")
    store.set(_exchange._key(0, 1), '"one"')
    assert _exchange.gathered(ch, 0, 2, "zero", 5.0) == ["zero", "one"]


# Rank 1 of 2 waits for rank 0's value, which never comes: rank 1 names rank 0.
def test_a_rank_waiting_for_rank_0_names_it_when_it_never_comes():
    store, ch = lone_channel("rank0-missing")
    with pytest.raises(CommTimeout, match=r"did not arrive from rank 0 \(died, frozen"):
        _exchange.gathered(ch, 1, 2, "one", 1.0)




# Eight ranks make four exchanges in a row: each gets every rank's value in rank order every time; rank 0
# drops every earlier exchange once every rank came to the next.
def test_eight_ranks_exchange_in_a_row_and_old_exchanges_are_dropped():
    world, rounds = 8, 4

    def four(r, ch):
        return [_exchange.gathered(ch, r, world, {"rank": r, "round": n}, 20.0) for n in range(rounds)]

    server, got = run_ranks(world, four)
    for r in range(world):
        assert got[r] == [[{"rank": q, "round": n} for q in range(world)] for n in range(rounds)], r
    for n in (0, 1, 2):  # dropped at 1, 2 and 3
        assert not any(server.check([_exchange._key(n, k)]) for k in (*range(world), "who", "=")), n
    assert all(server.check([_exchange._key(3, k)]) for k in (*range(world), "who", "="))


# Values of 3 MB from each of four ranks: every rank reads 12 MB, which no single value of the store may
# hold (it refuses a set over 8 MiB): each rank's value stays its own key.
def test_values_that_together_pass_the_store_s_limit_on_one_value_still_reach_every_rank():
    world = 4

    def big(r, ch):
        return _exchange.gathered(ch, r, world, chr(ord("a") + r) * (3 << 20), 30.0)

    _, got = run_ranks(world, big)
    for r in range(world):
        assert [len(v) for v in got[r]] == [3 << 20] * world and [v[0] for v in got[r]] == list("abcd"), r




# The ranks' deadlines differ: rank 0 gives up at 2 s, rank 1 (came with it) would wait until 10 s, and
# rank 2 comes at 5 s, when rank 0 has settled the outcome. Every rank, rank 2 too (it read every value),
# raises the same CommTimeout naming rank 2. None returns while another raises.
def test_a_gather_whose_first_deadline_passed_is_the_same_timeout_on_every_rank():
    import time
    world = 3

    def staggered(r, ch):
        time.sleep({0: 0.0, 1: 0.0, 2: 5.0}[r])
        return _exchange.gathered(ch, r, world, r, {0: 2.0, 1: 10.0, 2: 10.0}[r], "every rank's phase times")

    got = each_rank(world, staggered)
    assert all(isinstance(e, CommTimeout) for e in got), got
    assert len({str(e) for e in got}) == 1, got
    assert "every rank's phase times did not arrive from rank 2" in str(got[0]), got
    assert [e.absent_ranks for e in got] == [[2], [2], [2]]


# Rank 2 never comes; rank 0 gives up at 1 s, rank 1 would wait 30 s: rank 0, settling the timeout, sets
# rank 2's key (never read then), so rank 1 wakes and raises it at once, not at its own deadline.
def test_a_gather_rank_still_waiting_raises_the_first_timeout_at_once():
    import time
    world = 3

    def two_come(r, ch):
        if r == 2:
            return None
        start = time.monotonic()
        with pytest.raises(CommTimeout, match=r"did not arrive from rank 2 \(died, frozen") as e:
            _exchange.gathered(ch, r, world, r, {0: 1.0, 1: 30.0}[r])
        return time.monotonic() - start

    seconds = run_ranks(world, two_come, timeout_s=90)[1]
    assert seconds[1] < 15.0, f"rank 1 raised after {seconds[1]:.1f} s, not at rank 0's deadline (1 s)"


# Rank 1's wait ends without the values (as at its deadline) after rank 0 read them all and settled "ok":
# rank 1 reads them and returns them too.
def test_a_gather_rank_whose_wait_ended_after_another_read_every_value_returns_them():
    import time
    world = 2

    def once(r, ch):
        if r == 1:
            store = ch[0]

            def ended(keys, *args):
                deadline = time.monotonic() + 20
                while not store.check([_exchange._key(0, "=")]) and time.monotonic() < deadline:
                    time.sleep(0.05)  # rank 0 meanwhile reads both values and settles
                raise TimeoutError("the wait ended")
            ch = (WaitReplaced(store, ended), *ch[1:])
        return _exchange.gathered(ch, r, world, f"value {r}", 30.0)

    assert each_rank(world, once) == [["value 0", "value 1"]] * 2


# Regression: rank 1 came right after rank 0, whose wait had ended, found a value missing; rank 0 then read
# who came (everyone) and settled a timeout naming nobody, which both raised. Who came is read first now:
# the timeout names rank 1, on both ranks.
def test_a_gather_timeout_names_the_rank_it_waited_for_even_one_that_came_meanwhile():
    store, ch = lone_channel("came-during-the-check")

    class Rank0Store(ReadsRecorded):
        def wait(self, keys, *args):
            raise dist.DistStoreError("the wait timed out")  # rank 0's deadline passed

        def check(self, keys):
            there = self._store.check(keys)
            if len(keys) > 1:  # rank 1 comes right after rank 0 looked for every value
                self._store.set(_exchange._key(0, 1), '"one"')
                self._store.append(_exchange._key(0, "who"), "1 ")
            return there

    raised = []
    for r, c in ((0, (Rank0Store(store, []), *ch[1:])), (1, (store, "came-during-the-check-1", *ch[2:]))):
        with pytest.raises(CommTimeout, match=r"did not arrive from rank 1 \(died, frozen") as e:
            _exchange.gathered(c, r, 2, r, 5.0)
        raised.append((str(e.value), e.value.absent_ranks))
    assert raised[0] == raised[1] and raised[0][1] == [1], raised


# A rank whose wait ended just as the last rank came (every value there, no outcome yet) settles "ok" and
# returns every value rather than a timeout naming nobody.
def test_a_gather_rank_whose_wait_ended_as_the_last_came_returns_every_value():
    store, ch = lone_channel("last-came-at-the-deadline")
    store.set(_exchange._key(0, 1), '"one"')

    def ended(keys, *args):
        raise TimeoutError("the wait ended")
    ch = (WaitReplaced(store, ended), *ch[1:])
    assert _exchange.gathered(ch, 0, 2, "zero", 5.0) == ["zero", "one"]
