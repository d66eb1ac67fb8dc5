"""The exchanges before the handshake (_exchange.py) over a real TCPStore: a rank whose value never comes
is named in the CommTimeout every waiting rank raises."""
import datetime
import threading
import time

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


# Eight ranks make four exchanges in a row: each gets every rank's value in rank order every time; rank 0
# drops every earlier exchange once every rank came to the next.
def test_eight_ranks_exchange_in_a_row_and_old_exchanges_are_dropped():
    world, rounds = 8, 4

    def four(r, ch):
        return [_exchange.gathered(ch, r, world, {"rank": r, "round": n}, 20.0) for n in range(rounds)]

    server, got = _ranks(world, four)
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

    _, got = _ranks(world, big)
    for r in range(world):
        assert [len(v) for v in got[r]] == [3 << 20] * world and [v[0] for v in got[r]] == list("abcd"), r


def _decide(every):
    """A decision as `agree` makes one: something common, and a part for each 'node' (a rank's value % 3)."""
    parts = {}
    for r, v in enumerate(every):
        parts.setdefault(f"node {v % 3}", []).append(r)
    return {"": {"sum": sum(every)}, **parts}


# Eight ranks make four exchanges in a row, decided and gathered interleaved: each rank gets rank 0's common
# answer and its own part; a part decide gave none of is None; rank 0 drops every earlier exchange once
# every rank came to the next, its answers too.
def test_rank_0_decides_for_eight_ranks_in_a_row_and_old_answers_are_dropped():
    world = 8

    def four(r, ch):
        return [_exchange.decided(ch, r, world, r, _decide, 20.0, "decided", part=f"node {r % 3}"),
                _exchange.gathered(ch, r, world, r, 20.0),
                _exchange.decided(ch, r, world, r + 1, _decide, 20.0, "decided", part="node none"),
                _exchange.decided(ch, r, world, r, _decide, 20.0, "decided")]

    server, got = _ranks(world, four)
    for r in range(world):
        assert got[r][0] == ({"sum": 28}, [q for q in range(world) if q % 3 == r % 3]), r
        assert got[r][1] == list(range(world)), r
        assert got[r][2] == ({"sum": 36}, None), r
        assert got[r][3] == ({"sum": 28}, {"sum": 28}), r  # the part "" is the common answer
    for n, k in [(n, k) for n in (0, 1, 2) for k in (*range(world), "who", "=", "=node 0", "=node 1")]:
        assert not server.check([_exchange._key(n, k)]), (n, k)
    assert all(server.check([_exchange._key(3, k)]) for k in (*range(world), "who", "="))


class _Reads:
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


# What moves through the store: rank 0 reads every rank's value, every other rank only the outcome and its
# part (W + 2 (W - 1) values in all, where gathered reads W^2).
def test_only_rank_0_reads_every_rank_s_value():
    world, reads = 6, {}

    def once(r, ch):
        reads[r] = []
        ch = (_Reads(ch[0], reads[r]), *ch[1:])
        return _exchange.decided(ch, r, world, r, _decide, 20.0, "decided", part=f"node {r % 3}")

    _ranks(world, once)
    assert sorted(reads[0]) == sorted(_exchange._key(0, r) for r in range(world)), reads[0]
    for r in range(1, world):
        assert sorted(reads[r]) == sorted(_exchange._key(0, k) for k in ("=", f"=node {r % 3}")), (r, reads[r])


# Rank 3 of 4 never comes: rank 0, waiting for its value, and ranks 1 and 2, waiting for rank 0's answer,
# all name rank 3.
def test_a_rank_that_never_comes_is_named_by_every_rank_that_waited():
    world = 4

    def three_come(r, ch):
        if r == 3:
            return None
        with pytest.raises(CommTimeout, match=r"did not arrive from rank 3 \(died, frozen") as e:
            _exchange.decided(ch, r, world, r, _decide, 2.0, "decided")
        return e.value.absent_ranks

    _, got = _ranks(world, three_come)
    assert got == [[3], [3], [3], None]


# Every rank came, rank 0 too (its value and its word are set as decided would set them), but rank 0's
# answer never comes: rank 1 names rank 0.
def test_a_rank_0_that_came_and_never_answered_is_named():
    store, ch = _channel("rank0-never-answered")
    store.set(_exchange._key(0, 0), "0")
    store.append(_exchange._key(0, "who"), "0 ")
    with pytest.raises(CommTimeout, match=r"did not arrive from rank 0 \(died, frozen") as e:
        _exchange.decided(ch, 1, 2, 1, _decide, 1.0, "decided")
    assert e.value.absent_ranks == [0]


# decide raising on rank 0 is an InternalError on every rank naming rank 0, raised on rank 0 from the
# original error.
def test_a_decision_that_fails_on_rank_0_fails_on_every_rank():
    from shardcast._shardcast import InternalError
    world = 3

    def bad(every):
        raise ValueError(f"cannot decide from {len(every)} values")

    def once(r, ch):
        with pytest.raises(InternalError, match=r"rank 0 could not decide \(ValueError: cannot decide from 3") as e:
            _exchange.decided(ch, r, world, r, bad, 20.0, "decided")
        return type(e.value.__cause__).__name__

    _, got = _ranks(world, once)
    assert got == ["ValueError", "NoneType", "NoneType"]


# A decision interrupted on rank 0 (Ctrl-C there, or SystemExit): rank 0 raises the interrupt itself, and
# every other rank learns it at once (an InternalError naming it), not at its deadline.
def test_a_decision_interrupted_on_rank_0_ends_every_rank_at_once():
    from shardcast._shardcast import InternalError
    world = 3

    def interrupted(every):
        raise KeyboardInterrupt("pressed")

    def once(r, ch):
        start = time.monotonic()
        if r == 0:
            with pytest.raises(KeyboardInterrupt):
                _exchange.decided(ch, r, world, r, interrupted, 30.0, "decided")
        else:
            with pytest.raises(InternalError, match=r"rank 0 could not decide \(KeyboardInterrupt: pressed"):
                _exchange.decided(ch, r, world, r, interrupted, 30.0, "decided")
        return time.monotonic() - start

    took = _ranks(world, once, timeout_s=40)[1]
    assert max(took) < 10, took  # told, not timed out (30 s)


# decided, computed_on_rank0 (which waits for no rank) and gathered in a row, rank 1 slow to read its answer:
# rank 0 runs ahead to the gather, and drops the decided exchange only once rank 1 came to the gather.
def test_no_rank_s_answer_is_dropped_before_it_read_it():
    import time
    world = 2

    def three(r, ch):
        if r == 1:
            real = ch[0].wait

            def slow(keys, *args):
                time.sleep(1.0)  # rank 0 meanwhile decides, computes and reaches the gather
                return real(keys, *args)
            ch = (_Waits(ch[0], slow), *ch[1:])
        return [_exchange.decided(ch, r, world, r, _decide, 20.0, "decided", part=f"node {r % 3}"),
                _exchange.computed_on_rank0(ch, r, world, lambda: "keys", 20.0),
                _exchange.gathered(ch, r, world, r, 20.0)]

    _, got = _ranks(world, three)
    assert got == [[({"sum": 1}, [0]), "keys", [0, 1]], [({"sum": 1}, [1]), "keys", [0, 1]]]


class _Waits(_Reads):
    """A store whose wait is another function."""

    def __init__(self, store, wait):
        super().__init__(store, [])
        self.wait = wait


# Rank 0 decides later than the others' deadline (every rank came in time): every rank, rank 0 too, raises
# the same CommTimeout, the first to give up having settled the outcome; none returns while another raises.
def test_a_decision_later_than_the_deadline_is_the_same_timeout_on_every_rank():
    import time
    world = 3

    def slow(every):
        time.sleep(2.0)
        return _decide(every)

    def once(r, ch):
        with pytest.raises(CommTimeout) as e:
            _exchange.decided(ch, r, world, r, slow, 1.0, "decided")
        return str(e.value), e.value.absent_ranks

    _, got = _ranks(world, once)
    assert got[0] == got[1] == got[2], got
    assert "did not arrive from rank 0" in got[0][0] and got[0][1] == [0], got


# An answer JSON cannot carry is decide failing: an InternalError on every rank, not the others' timeout.
def test_an_answer_json_cannot_carry_fails_on_every_rank_at_once():
    from shardcast._shardcast import InternalError
    world = 3

    def once(r, ch):
        with pytest.raises(InternalError, match=r"rank 0 could not decide \(TypeError"):
            _exchange.decided(ch, r, world, r, lambda every: {"": object()}, 20.0, "decided")
        return True

    assert _ranks(world, once, timeout_s=15)[1] == [True] * world


# Rank 0's answer lands after rank 1's wait gave up but before rank 1 settles the outcome (the state is set
# here as rank 0 leaves it mid-way: its outcome and parts, not yet the key the others wait on): rank 1 takes
# rank 0's answer, its part too, rather than a timeout or no part.
def test_a_rank_whose_wait_ended_takes_rank_0_s_answer_where_it_came_first():
    store, ch = _channel("answer-after-the-wait")
    store.set(_exchange._key(0, "=node 1"), '"mine"')
    store.set(_exchange._key(0, "="), '["ok", {"sum": 1}]')
    assert _exchange.decided(ch, 1, 2, 1, _decide, 1.0, "decided", part="node 1") == ({"sum": 1}, "mine")


def _each_rank(world, call, timeout_s=60):
    """As _ranks, but every rank's own outcome: its result, or the exception it raised."""
    def caught(r, ch):
        try:
            return call(r, ch)
        except Exception as e:  # noqa: BLE001 -- the rank's outcome
            return e
    caught.__name__ = call.__name__
    return _ranks(world, caught, timeout_s)[1]


# The ranks' deadlines differ: rank 0 gives up at 2 s, rank 1 (came with it) would wait until 10 s, and
# rank 2 comes at 5 s, when rank 0 has settled the outcome. Every rank, rank 2 too (it read every value),
# raises the same CommTimeout naming rank 2. None returns while another raises.
def test_a_gather_whose_first_deadline_passed_is_the_same_timeout_on_every_rank():
    import time
    world = 3

    def staggered(r, ch):
        time.sleep({0: 0.0, 1: 0.0, 2: 5.0}[r])
        return _exchange.gathered(ch, r, world, r, {0: 2.0, 1: 10.0, 2: 10.0}[r], "every rank's phase times")

    got = _each_rank(world, staggered)
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

    seconds = _ranks(world, two_come, timeout_s=90)[1]
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
            ch = (_Waits(store, ended), *ch[1:])
        return _exchange.gathered(ch, r, world, f"value {r}", 30.0)

    assert _each_rank(world, once) == [["value 0", "value 1"]] * 2


# Regression: rank 1 came right after rank 0, whose wait had ended, found a value missing; rank 0 then read
# who came (everyone) and settled a timeout naming nobody, which both raised. Who came is read first now:
# the timeout names rank 1, on both ranks.
def test_a_gather_timeout_names_the_rank_it_waited_for_even_one_that_came_meanwhile():
    store, ch = _channel("came-during-the-check")

    class Rank0Store(_Reads):
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
    store, ch = _channel("last-came-at-the-deadline")
    store.set(_exchange._key(0, 1), '"one"')

    def ended(keys, *args):
        raise TimeoutError("the wait ended")
    ch = (_Waits(store, ended), *ch[1:])
    assert _exchange.gathered(ch, 0, 2, "zero", 5.0) == ["zero", "one"]
