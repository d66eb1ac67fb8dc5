"""from_pretrained's first exchange (shardcast/_stream_rules.py): every rank's reason not to stream, node and
CPUs become one Verdict, the same on every rank but for its node's part. Several ranks' answers are given
to `agree` as its exchange would return them (the exchange itself runs in test_pretrained_stream.py's
multi-process scenarios)."""
import os

import pytest

from shardcast import _exchange, _stream_rules
from shardcast._stream_rules import agree


def mask(*cpus):
    return format(sum(1 << c for c in cpus), "x")


def verdicts(monkeypatch, answers):
    """Each rank's Verdict where the exchange returned `answers` (rank order; each rank's [reason, by the
    cores, hostname, node, CPU mask], as it sends them)."""
    monkeypatch.setattr(_exchange, "gathered", lambda ch, rank, world, mine, timeout_s, what: answers)
    return [agree(None, None, r, len(answers), answers[r][0], 5.0, by_cores=answers[r][1]) for r in range(len(answers))]


def test_a_node_is_its_ranks_cpus_together_in_rank_order(monkeypatch):
    """Two hosts, ranks interleaved across them, each rank bound to CPUs of its own (srun --cpu-bind): a node's
    CPUs are its ranks' masks together, its local ranks come in rank order, and a node is its boot id, not
    its hostname (two containers called the same on two hosts are two nodes)."""
    answers = [[None, True, "same-name", "boot-a", mask(0, 1)],
               [None, True, "same-name", "boot-b", mask(0, 1, 2, 3)],
               [None, True, "same-name", "boot-a", mask(2, 3)],
               [None, True, "same-name", "boot-b", mask(4, 5, 6, 7)]]
    got = verdicts(monkeypatch, answers)
    assert [(v.local_rank, v.local_world, v.nodes) for v in got] == [(0, 2, 2), (0, 2, 2), (1, 2, 2), (1, 2, 2)]
    assert all(v.stream and v.spare_cores for v in got), got  # 4 CPUs for 2 ranks on a, 8 for 2 on b


def test_one_node_short_of_cpus_keeps_every_rank_from_streaming_and_only_its_own_from_reading_ahead(monkeypatch):
    answers = [[None, True, "a", "boot-a", mask(0, 1, 2, 3)],
               [None, True, "a", "boot-a", mask(0, 1, 2, 3)],
               [None, True, "b", "boot-b", mask(0)],
               [None, True, "b", "boot-b", mask(1)]]
    got = verdicts(monkeypatch, answers)
    assert [v.stream for v in got] == [False] * 4
    assert [v.spare_cores for v in got] == [True, True, False, False]
    # A caller who asked for the stream (not by the cores) streams whatever the CPUs, which still decide
    # the read-ahead.
    asked = verdicts(monkeypatch, [[why, False, *rest] for why, _, *rest in answers])
    assert [v.stream for v in asked] == [True] * 4
    assert [v.spare_cores for v in asked] == [True, True, False, False]


def test_any_rank_s_reason_is_every_rank_s_and_logged_once_naming_it(monkeypatch, caplog):
    answers = [[None, False, "a", "boot-a", mask(0, 1, 2, 3)],
               ["stream_beside_build=False", False, "a", "boot-a", mask(0, 1, 2, 3)]]
    with caplog.at_level("DEBUG", logger="shardcast"):
        got = verdicts(monkeypatch, answers)
    assert [v.stream for v in got] == [False, False]
    lines = [r.getMessage() for r in caplog.records if "not beside it" in r.getMessage()]
    assert len(lines) == 2 and all("rank 1: stream_beside_build=False" in line for line in lines), lines


def test_the_node_verdict_of_a_world_of_one_counts_its_own_cpus():
    """No exchange in a world of one: its own affinity mask is the node's. Two CPUs a rank or more: spare."""
    cpus = sorted(os.sched_getaffinity(0))
    try:
        os.sched_setaffinity(0, cpus[:1])
        one = agree(None, None, 0, 1, None, 5.0, by_cores=True)
        assert (one.stream, one.spare_cores, one.local_rank, one.local_world, one.nodes) == (False, False, 0, 1, 1)
        if len(cpus) < 2:
            pytest.skip("this process may run on one CPU only")
        os.sched_setaffinity(0, cpus[:2])
        two = agree(None, None, 0, 1, None, 5.0, by_cores=True)
        assert (two.stream, two.spare_cores) == (True, True)
        assert not agree(None, None, 0, 1, "a reason", 5.0).stream
    finally:
        os.sched_setaffinity(0, cpus)


def test_a_node_is_the_kernel_the_rank_runs_on():
    node = _stream_rules.node_id()
    assert node and node == _stream_rules.node_id()
    if os.path.exists("/proc/sys/kernel/random/boot_id"):
        assert node == open("/proc/sys/kernel/random/boot_id").read().strip()
