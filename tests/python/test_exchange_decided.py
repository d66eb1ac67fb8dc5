"""Exchanges decided on rank 0 (_decided.decided) over a real TCPStore: every rank gets rank 0's common answer
and its own part, or the same error, whatever the order the ranks came in and the deadlines passed in."""
import time

import pytest

from shardcast import _decided, _exchange
from shardcast._shardcast import CommTimeout
from store_ranks import ReadsRecorded, WaitReplaced, lone_channel, run_ranks


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
        return [_decided.decided(ch, r, world, r, _decide, 20.0, "decided", part=f"node {r % 3}"),
                _exchange.gathered(ch, r, world, r, 20.0),
                _decided.decided(ch, r, world, r + 1, _decide, 20.0, "decided", part="node none"),
                _decided.decided(ch, r, world, r, _decide, 20.0, "decided")]

    server, got = run_ranks(world, four)
    for r in range(world):
        assert got[r][0] == ({"sum": 28}, [q for q in range(world) if q % 3 == r % 3]), r
        assert got[r][1] == list(range(world)), r
        assert got[r][2] == ({"sum": 36}, None), r
        assert got[r][3] == ({"sum": 28}, {"sum": 28}), r  # the part "" is the common answer
    for n, k in [(n, k) for n in (0, 1, 2) for k in (*range(world), "who", "=", "=node 0", "=node 1")]:
        assert not server.check([_exchange._key(n, k)]), (n, k)
    assert all(server.check([_exchange._key(3, k)]) for k in (*range(world), "who", "="))


# What moves through the store: rank 0 reads every rank's value, every other rank only the outcome and its
# part (W + 2 (W - 1) values in all, where gathered reads W^2).
def test_only_rank_0_reads_every_rank_s_value():
    world, reads = 6, {}

    def once(r, ch):
        reads[r] = []
        ch = (ReadsRecorded(ch[0], reads[r]), *ch[1:])
        return _decided.decided(ch, r, world, r, _decide, 20.0, "decided", part=f"node {r % 3}")

    run_ranks(world, once)
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
            _decided.decided(ch, r, world, r, _decide, 2.0, "decided")
        return e.value.absent_ranks

    _, got = run_ranks(world, three_come)
    assert got == [[3], [3], [3], None]


# Every rank came, rank 0 too (its value and its word are set as decided would set them), but rank 0's
# answer never comes: rank 1 names rank 0.
def test_a_rank_0_that_came_and_never_answered_is_named():
    store, ch = lone_channel("rank0-never-answered")
    store.set(_exchange._key(0, 0), "0")
    store.append(_exchange._key(0, "who"), "0 ")
    with pytest.raises(CommTimeout, match=r"did not arrive from rank 0 \(died, frozen") as e:
        _decided.decided(ch, 1, 2, 1, _decide, 1.0, "decided")
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
            _decided.decided(ch, r, world, r, bad, 20.0, "decided")
        return type(e.value.__cause__).__name__

    _, got = run_ranks(world, once)
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
                _decided.decided(ch, r, world, r, interrupted, 30.0, "decided")
        else:
            with pytest.raises(InternalError, match=r"rank 0 could not decide \(KeyboardInterrupt: pressed"):
                _decided.decided(ch, r, world, r, interrupted, 30.0, "decided")
        return time.monotonic() - start

    took = run_ranks(world, once, timeout_s=40)[1]
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
            ch = (WaitReplaced(ch[0], slow), *ch[1:])
        return [_decided.decided(ch, r, world, r, _decide, 20.0, "decided", part=f"node {r % 3}"),
                _exchange.computed_on_rank0(ch, r, world, lambda: "keys", 20.0),
                _exchange.gathered(ch, r, world, r, 20.0)]

    _, got = run_ranks(world, three)
    assert got == [[({"sum": 1}, [0]), "keys", [0, 1]], [({"sum": 1}, [1]), "keys", [0, 1]]]


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
            _decided.decided(ch, r, world, r, slow, 1.0, "decided")
        return str(e.value), e.value.absent_ranks

    _, got = run_ranks(world, once)
    assert got[0] == got[1] == got[2], got
    assert "did not arrive from rank 0" in got[0][0] and got[0][1] == [0], got


# An answer JSON cannot carry is decide failing: an InternalError on every rank, not the others' timeout.
def test_an_answer_json_cannot_carry_fails_on_every_rank_at_once():
    from shardcast._shardcast import InternalError
    world = 3

    def once(r, ch):
        with pytest.raises(InternalError, match=r"rank 0 could not decide \(TypeError"):
            _decided.decided(ch, r, world, r, lambda every: {"": object()}, 20.0, "decided")
        return True

    assert run_ranks(world, once, timeout_s=15)[1] == [True] * world


# Rank 0's answer lands after rank 1's wait gave up but before rank 1 settles the outcome (the state is set
# here as rank 0 leaves it mid-way: its outcome and parts, not yet the key the others wait on): rank 1 takes
# rank 0's answer, its part too, rather than a timeout or no part.
def test_a_rank_whose_wait_ended_takes_rank_0_s_answer_where_it_came_first():
    store, ch = lone_channel("answer-after-the-wait")
    store.set(_exchange._key(0, "=node 1"), '"mine"')
    store.set(_exchange._key(0, "="), '["ok", {"sum": 1}]')
    assert _decided.decided(ch, 1, 2, 1, _decide, 1.0, "decided", part="node 1") == ({"sum": 1}, "mine")
