"""from_pretrained's first exchange (shardcast/_stream_rules.py): every rank's reason not to stream, node and
CPUs become one Verdict, the same on every rank but for its node's part. Several ranks' answers are given
to `agree` as its exchange would return them (the exchange itself runs in test_pretrained_stream.py's
multi-process scenarios)."""
import os
import pathlib

import pytest

from shardcast import _decided, _stream_rules
from shardcast._stream_rules import agree


def mask(*cpus):
    return format(sum(1 << c for c in cpus), "x")


def verdicts(monkeypatch, answers):
    """Each rank's Verdict where the exchange returned `answers` (rank order; each rank's [reason, by the
    cores, hostname, node, CPU mask, CPU cgroup, its quota, whether it failed already], as it sends them; the
    last may be left out: not failed)."""
    answers = [a + [None] if len(a) == 7 else a for a in answers]

    def decided(ch, rank, world, mine, decide, timeout_s, what, part=""):
        assert part == f"node {mine[3]}"  # the part a rank asks for is the node it sends
        told = decide(answers)  # rank 0's decision; each rank reads the common answer and its (given) node's part
        return told[""], told[f"node {answers[rank][3]}"]
    monkeypatch.setattr(_decided, "decided", decided)
    return [agree(None, None, r, len(answers), answers[r][0], 5.0, by_cores=answers[r][1], failed=answers[r][7])
            for r in range(len(answers))]


def test_a_node_is_its_ranks_cpus_together_in_rank_order(monkeypatch):
    """Two hosts, ranks interleaved across them, each rank bound to CPUs of its own (srun --cpu-bind): a node's
    CPUs are its ranks' masks together, its local ranks come in rank order, and a node is its boot id, not
    its hostname (two containers called the same on two hosts are two nodes)."""
    answers = [[None, True, "same-name", "boot-a", mask(0, 1), "cg", None],
               [None, True, "same-name", "boot-b", mask(0, 1, 2, 3), "cg", None],
               [None, True, "same-name", "boot-a", mask(2, 3), "cg", None],
               [None, True, "same-name", "boot-b", mask(4, 5, 6, 7), "cg", None]]
    got = verdicts(monkeypatch, answers)
    assert [(v.local_rank, v.local_world, v.nodes) for v in got] == [(0, 2, 2), (0, 2, 2), (1, 2, 2), (1, 2, 2)]
    assert all(v.stream and v.spare_cores for v in got), got  # 4 CPUs for 2 ranks on a, 8 for 2 on b


def test_one_node_short_of_cpus_keeps_every_rank_from_streaming_and_only_its_own_from_reading_ahead(monkeypatch):
    answers = [[None, True, "a", "boot-a", mask(0, 1, 2, 3), "cg", None],
               [None, True, "a", "boot-a", mask(0, 1, 2, 3), "cg", None],
               [None, True, "b", "boot-b", mask(0), "cg", None],
               [None, True, "b", "boot-b", mask(1), "cg", None]]
    got = verdicts(monkeypatch, answers)
    assert [v.stream for v in got] == [False] * 4
    assert [v.spare_cores for v in got] == [True, True, False, False]
    # A caller who asked for the stream (not by the cores) streams whatever the CPUs, which still decide
    # the read-ahead.
    asked = verdicts(monkeypatch, [[why, False, *rest] for why, _, *rest in answers])
    assert [v.stream for v in asked] == [True] * 4
    assert [v.spare_cores for v in asked] == [True, True, False, False]


def test_the_ranks_that_failed_already_are_one_error_on_every_rank(monkeypatch):
    """from_pretrained's ranks then raise it at once, none building a model that will not be loaded."""
    from shardcast import CheckpointError
    answers = [[None, False, "a", "boot-a", mask(0, 1), "cg", None, None],
               ["it failed already (CheckpointError)", False, "a", "boot-a", mask(0, 1), "cg", None,
                ["CheckpointError", "/ckpt: no such directory"]],
               [None, False, "a", "boot-a", mask(0, 1), "cg", None, None],
               ["it failed already (InvalidArgument)", False, "a", "boot-a", mask(0, 1), "cg", None,
                ["InvalidArgument", "SHARDCAST_TARGET: bad"]]]
    got = verdicts(monkeypatch, answers)
    assert [v.failed for v in got] == [((1, "CheckpointError", "/ckpt: no such directory"),
                                        (3, "InvalidArgument", "SHARDCAST_TARGET: bad"))] * 4
    assert [v.stream for v in got] == [False] * 4
    raised = []
    for v in got:
        with pytest.raises(CheckpointError) as e:
            _stream_rules.raise_failed(v, 4, None)
        raised.append(str(e.value))
    assert raised == ["from_pretrained, before the model was built: failed on ranks 1, 3 of 4:\n"
                      "  [rank 1] /ckpt: no such directory\n  [rank 3] SHARDCAST_TARGET: bad"] * 4
    assert [v.failed for v in verdicts(monkeypatch, [a[:7] for a in answers])] == [()] * 4


def test_many_failed_ranks_are_named_as_runs_with_the_first_eight_problems(monkeypatch):
    """Every failing rank is named, in runs, as the load's verdict names them; the first 8 with their problem."""
    from shardcast import InvalidArgument
    ok = [None, False, "a", "boot-a", mask(0, 1), "cg", None, None]
    bad = ["it failed already (InvalidArgument)", False, "a", "boot-a", mask(0, 1), "cg", None,
           ["InvalidArgument", "SHARDCAST_TARGET: bad"]]
    answers = [ok] + [bad] * 11 + [ok, bad]  # ranks 1-11 and 13 of 14
    v = verdicts(monkeypatch, answers)[0]
    with pytest.raises(InvalidArgument) as e:
        _stream_rules.raise_failed(v, 14, None)
    assert str(e.value) == ("from_pretrained, before the model was built: failed on ranks 1-11, 13 of 14:"
                            + "".join(f"\n  [rank {r}] SHARDCAST_TARGET: bad" for r in range(1, 9))
                            + "\n  (the problems of 4 more ranks are not shown)")


def test_a_failure_whose_path_is_not_utf8_is_raised_as_its_escapes(monkeypatch):
    """A path decoded with surrogateescape (a byte that is not UTF-8) keeps a lone surrogate through the
    exchange: every rank still raises the agreed error, the byte written as its escape."""
    from shardcast import CheckpointError
    answers = [[None, False, "a", "boot-a", mask(0, 1), "cg", None, None],
               ["it failed already (CheckpointError)", False, "a", "boot-a", mask(0, 1), "cg", None,
                ["CheckpointError", "/ckpt/\udcff: no such directory"]]]
    with pytest.raises(CheckpointError) as e:
        _stream_rules.raise_failed(verdicts(monkeypatch, answers)[0], 2, None)
    assert str(e.value) == ("from_pretrained, before the model was built: failed on rank 1 of 2:\n"
                            "  [rank 1] /ckpt/\\udcff: no such directory")


def test_a_long_failure_is_cut_saying_so(monkeypatch):
    """A failed rank's message over 1,024 characters travels cut, and says how much was left out."""
    long = "x" * 1500
    answers = [[None, False, "a", "boot-a", mask(0, 1), "cg", None, None],
               ["it failed already (CheckpointError)", False, "a", "boot-a", mask(0, 1), "cg", None, None]]
    seen = {}

    def decided(ch, rank, world, mine, decide, timeout_s, what, part=""):
        seen[rank] = mine[7]
        told = decide([answers[0][:7] + [seen.get(0)], answers[1][:7] + [seen.get(1)]])
        return told[""], told["node boot-a"]
    monkeypatch.setattr(_decided, "decided", decided)
    agree(None, None, 0, 2, None, 5.0)
    v = agree(None, None, 1, 2, "it failed already", 5.0, failed=("CheckpointError", long))
    message = v.failed[0][2]
    assert message == "x" * 1024 + " [... cut: 476 more characters, whole in that rank's own exception]"
    assert _stream_rules._cut("y" * 1024) == "y" * 1024  # at the limit: whole


def test_any_rank_s_reason_is_every_rank_s_and_logged_once_naming_it(monkeypatch, caplog):
    answers = [[None, False, "a", "boot-a", mask(0, 1, 2, 3), "cg", None],
               ["stream_beside_build=False", False, "a", "boot-a", mask(0, 1, 2, 3), "cg", None]]
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


def test_cgroup_cpu_quotas_bound_a_node_s_cpus_where_every_rank_has_one(monkeypatch):
    """A pod's CPU limit: its ranks see every CPU of the host in their masks, but their cgroup's quota is what
    they get. One cgroup's quota is counted once however many ranks share it; two cgroups' add up; a rank
    with no quota leaves the masks as the bound."""
    def node(quotas, cpus=16):
        return [[None, True, "h", "boot", mask(*range(cpus)), cg, q] for cg, q in quotas]
    assert [v.spare_cores for v in verdicts(monkeypatch, node([("pod", 4.0)] * 4))] == [False] * 4
    assert [v.spare_cores for v in verdicts(monkeypatch, node([("pod", 8.0)] * 4))] == [True] * 4
    assert [v.spare_cores for v in verdicts(monkeypatch, node([("a", 4.0), ("a", 4.0), ("b", 4.0), ("b", 4.0)]))] \
        == [True] * 4
    assert [v.spare_cores for v in verdicts(monkeypatch, node([("a", 2.0), ("a", 2.0), ("b", None), ("b", None)]))] \
        == [True] * 4
    assert [v.spare_cores for v in verdicts(monkeypatch, node([("pod", 100.0)] * 4, cpus=6))] == [False] * 4
    # Fractional quotas that add up to whole CPUs count as those CPUs (0.7 + 0.2 + 0.1 is not 0.99...).
    eight = [("a", 0.7), ("b", 0.2), ("c", 0.1), ("d", 7.0)]
    assert [v.spare_cores for v in verdicts(monkeypatch, node(eight))] == [True] * 4


def test_a_cgroup_that_cannot_be_read_never_keeps_a_rank_out_of_the_exchange(monkeypatch):
    def broken():
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a cgroup path that is not UTF-8")
    monkeypatch.setattr(_stream_rules, "cpu_quota", broken)
    one = agree(None, None, 0, 1, "a reason", 5.0)
    assert one.stream is False and one.local_world == 1


def _cgroup(tmp_path, lines, files):
    tmp_path.mkdir(parents=True, exist_ok=True)
    proc = tmp_path / "cgroup"
    proc.write_text("".join(f"{line}\n" for line in lines))
    root = tmp_path / "fs"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    root.mkdir(exist_ok=True)
    return str(root), str(proc)


def test_a_cgroup_v2_quota_is_the_lowest_of_its_cgroup_and_its_parents(tmp_path):
    root, proc = _cgroup(tmp_path, ["0::/kubepods/pod1/ctr"], {
        "cgroup.controllers": "cpu", "kubepods/cpu.max": "max 100000", "kubepods/pod1/cpu.max": "150000 100000",
        "kubepods/pod1/ctr/cpu.max": "400000 100000"})
    name, quota = _stream_rules.cpu_quota(root, proc)  # the pod's limit, named by the pod's cgroup
    assert quota == 1.5 and name == str(os.stat(os.path.join(root, "kubepods/pod1")).st_ino)
    # A second container of the same pod, with no limit of its own: the same cgroup's quota, counted once.
    (pathlib.Path(root) / "kubepods/pod1/other").mkdir()
    proc_other = tmp_path / "cgroup-other"
    proc_other.write_text("0::/kubepods/pod1/other\n")
    assert _stream_rules.cpu_quota(root, str(proc_other)) == (name, 1.5)
    # Inside the container's own cgroup namespace: "/" is its cgroup, the mount its directory.
    root, proc = _cgroup(tmp_path / "ns", ["0::/"], {"cgroup.controllers": "cpu", "cpu.max": "250000 100000"})
    assert _stream_rules.cpu_quota(root, proc)[1] == 2.5
    root, proc = _cgroup(tmp_path / "none", ["0::/"], {"cgroup.controllers": "cpu"})
    assert _stream_rules.cpu_quota(root, proc)[1] is None


def test_a_cgroup_v1_quota_and_what_cannot_be_read(tmp_path):
    root, proc = _cgroup(tmp_path, ["4:memory:/x", "2:cpu,cpuacct:/slurm/job1", "0::/"], {
        "cpu,cpuacct/cpu.cfs_quota_us": "-1", "cpu,cpuacct/cpu.cfs_period_us": "100000",
        "cpu,cpuacct/slurm/job1/cpu.cfs_quota_us": "300000", "cpu,cpuacct/slurm/job1/cpu.cfs_period_us": "100000"})
    assert _stream_rules.cpu_quota(root, proc)[1] == 3.0
    root, proc = _cgroup(tmp_path / "unlimited", ["1:cpu:/"], {"cpu/cpu.cfs_quota_us": "-1",
                                                              "cpu/cpu.cfs_period_us": "100000"})
    assert _stream_rules.cpu_quota(root, proc)[1] is None
    assert _stream_rules.cpu_quota(str(tmp_path / "absent"), str(tmp_path / "absent-proc")) == ("", None)
    root, proc = _cgroup(tmp_path / "garbled", ["0::/"], {"cgroup.controllers": "", "cpu.max": "lots"})
    assert _stream_rules.cpu_quota(root, proc)[1] is None
    assert isinstance(_stream_rules.cpu_quota()[0], str)  # this machine's, whatever it is


def test_a_hostile_cgroup_file_is_no_quota_and_never_an_exception(tmp_path):
    """The one reader (runtime/cpu_quota.h, through the binding) on what the kernel never writes: a path of
    bytes that are not UTF-8 is named as os.fsdecode names it; ".." (a cgroup outside the namespace's view)
    and lines without colons cannot be read."""
    root, proc = _cgroup(tmp_path, [], {"cgroup.controllers": "", "cpu.max": "max 100000"})
    pathlib.Path(proc).write_bytes(b"0::/gone\xff\n")
    name, quota = _stream_rules.cpu_quota(root, proc)
    assert quota is None and os.fsencode(name) == os.fsencode(root) + b"/gone\xff", name
    pathlib.Path(proc).write_bytes(b"no colons\n0::/../../etc\n")
    assert _stream_rules.cpu_quota(root, proc) == ("", None)
    pathlib.Path(proc).write_bytes(b"no colons\n0::/\n")
    pathlib.Path(root, "cpu.max").write_text("100000 100000")
    assert _stream_rules.cpu_quota(pathlib.Path(root), pathlib.Path(proc))[1] == 1.0


def test_rank_0_s_verdict_after_the_build_is_the_first_problem_in_rank_order():
    """The stream's last exchange (`_stream._first_problem`, decided on rank 0): rank 0's value where every
    rank has it and no problem; else the first rank, in rank order, with a problem or another value."""
    from shardcast._stream import _first_problem
    same = [None, [["buf"], []]]
    assert _first_problem([same, same, same]) == {"": ["ok", [["buf"], []]]}
    told = _first_problem([same, [None, [["buf"], ["w"]]], same, [None, []]])
    assert told[""][:3] == ["failed", 1, "ManifestMismatch"] and "rank 0's [['buf'], []]" in told[""][3], told
    # A problem comes before a value that differs on an earlier rank, and rank order decides between problems.
    assert _first_problem([same, [None, [[], []]], [["ConfigError", "no"], None],
                           [["CommTimeout", "late"], None]]) == {"": ["failed", 2, "ConfigError", "no"]}
