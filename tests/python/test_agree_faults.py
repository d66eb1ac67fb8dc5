"""from_pretrained's store exchanges (`_stream_rules.agree`) with a rank frozen or killed in them: the other
ranks end on their own, in about one timeout, each with the same shardcast error, never a hang.

Real rank processes (W=3, c10d Gloo) load the tiny llama checkpoint with stream_beside_build=True and
timeout=6 s; the faulted rank stops (SIGSTOP) or kills itself (SIGKILL) as it enters the exchange, once
the others have entered it too (agree_faults_worker.py). Rank 0 serves the group's TCPStore, so rank 0
frozen leaves the others a store that never answers, and rank 0 killed one that is gone. Each scenario
kills or freezes a rank, so each has a launch of its own (ranks.run), whose deadline ends it if a rank
hangs; the test kills the frozen rank once the others are done."""
import pytest

import ranks
from agree_faults_worker import TIMEOUT  # from_pretrained(timeout=...) in the worker, seconds

WORLD = 3
# From entering the exchange to from_pretrained raising: one wait of the timeout and the store calls' grace
# (3 s, _exchange._GRACE_S), with as much again for a loaded 2-core machine. Two waits on a stalled
# store (2 x 9 s) would be past it.
IN_TIME = 2 * TIMEOUT + 3.0


def survivors_of(tmp_path, llama_root, mode, faulted):
    """The results of the ranks other than `faulted` in agree_faults_worker's `mode`, each checked: every
    rank entered the exchange (so the fault hit there), and each other rank raised a shardcast error
    within IN_TIME of entering it."""
    results = ranks.run("agree_faults_worker.py", mode, llama_root, WORLD, tmp_path, timeout=150,
                        allow_fail=True, faulted=(faulted,))
    for rank in range(WORLD):
        entered = tmp_path / f"{mode}-{WORLD}.entered.{rank}"
        assert entered.exists(), f"{mode}: rank {rank} never entered the exchange"
    assert results[faulted] is None, f"{mode}: rank {faulted} went on past its fault: {results[faulted]}"
    survivors = {rank: r for rank, r in enumerate(results) if rank != faulted}
    for rank, r in survivors.items():
        assert r is not None, f"{mode}: rank {rank} wrote no result"
        assert r["error"] is not None, f"{mode}: rank {rank} loaded although rank {faulted} was faulted: {r}"
        assert r["error"]["shardcast"], f"{mode}: rank {rank} raised a non-shardcast error: {r['error']}"
        assert r["seconds"] < IN_TIME, (f"{mode}: rank {rank} raised {r['seconds']:.1f} s after entering the "
                                        f"exchange (timeout {TIMEOUT:g} s): {r['error']}")
    return survivors


@pytest.fixture
def llama(tiny_checkpoints):
    return tiny_checkpoints("tied", models=("llama",))


def one_error(survivors):
    """The error every surviving rank raised, word for word the same on each."""
    errors = [r["error"] for r in survivors.values()]
    assert len({(e["class"], e["message"]) for e in errors}) == 1, f"the ranks raised differently: {survivors}"
    return errors[0]


def assert_one_timeout_naming(survivors, absent):
    e = one_error(survivors)
    assert e["class"] == "CommTimeout", e
    assert e["absent_ranks"] == absent, e
    assert f"from rank {absent[0]} (died, frozen" in e["message"], e


# Rank 0 serves the store: frozen, it answers neither a set nor the cancel of a timed-out wait. Ranks 1 and
# 2 must give up on the store at the deadline and raise the same CommTimeout saying so.
def test_rank_0_frozen_in_the_first_exchange_ends_the_others_with_one_stalled_store_timeout(tmp_path, llama):
    e = one_error(survivors_of(tmp_path, llama, "freeze-0-first", 0))
    assert e["class"] == "CommTimeout" and e["store_stalled"] is True, e
    assert "store of rank 0" in e["message"] and "does not answer (its server stalled)" in e["message"], e


# A rank other than rank 0 frozen: the store answers, so the ranks that came settle one outcome in it,
# the timeout naming the frozen rank, which each of them raises word for word.
def test_a_rank_frozen_in_the_first_exchange_is_one_timeout_naming_it_on_every_other_rank(tmp_path, llama):
    assert_one_timeout_naming(survivors_of(tmp_path, llama, "freeze-2-first", 2), [2])


# Rank 0 dead takes the store with it: the others must each raise the same error word for word, the store
# lost, naming its host, never a raw c10d error or a hang, whether a rank lost the store in a send, in a
# receive, or in a call still waiting when rank 0 died (its port refuses then: _exchange._refuses).
def test_rank_0_killed_in_the_first_exchange_ends_the_others_with_one_comm_error(tmp_path, llama):
    e = one_error(survivors_of(tmp_path, llama, "kill-0-first", 0))
    assert e["class"] == "CommError", e
    assert "the store of rank 0 (the store host at " in e["message"], e
    assert e["message"].endswith(") is lost: its connection closed or its port refuses connections"), e


# The second exchange (every rank planned its part of the stream): the same as the first.
def test_a_rank_frozen_in_the_second_exchange_is_one_timeout_naming_it_on_every_other_rank(tmp_path, llama):
    assert_one_timeout_naming(survivors_of(tmp_path, llama, "freeze-2-second", 2), [2])
