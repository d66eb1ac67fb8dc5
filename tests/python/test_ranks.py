"""ranks.Scenarios, the launcher the multi-rank tests share: one launch runs many scenarios, yet each test
still gets its own scenario's results, and a scenario that fails, or a rank that dies or hangs, fails only
the tests of the scenarios it touched, naming the scenario and the rank. Real processes (a worker without
torch, so a fresh launch takes well under a second). The ranks are forked by a server that imported torch and
transformers once, only where every rank's variables that those imports read are the server's own."""
import collections

import pytest

import forked
import ranks


def _launch(tmp_path_factory, by_world, timeout=60, env=None, rank_env=None, fork=True):
    return ranks.Scenarios("scenarios_worker.py", tmp_path_factory, by_world, root="/the/root", timeout=timeout,
                           env=env, rank_env=rank_env, fork=fork)


LIGHT = {"ZYGOTE_PRELOAD": "hub"}  # servers that import huggingface_hub's constants alone, not torch


def test_each_scenario_gets_its_own_results_root_and_variables(tmp_path_factory):
    run = _launch(tmp_path_factory, {2: [("echo:set", "/another/root", {"SCENARIO_VAR": "x"}), "echo"], 3: ["echo"]})
    assert run("echo:set", 2) == [{"rank": r, "world": 2, "root": "/another/root", "var": "x"} for r in range(2)]
    assert run("echo", 2) == [{"rank": r, "world": 2, "root": "/the/root", "var": None} for r in range(2)]
    assert [r["world"] for r in run("echo", 3)] == [3, 3, 3]


def test_a_scenario_that_raises_fails_its_test_only_naming_it_and_the_rank(tmp_path_factory):
    run = _launch(tmp_path_factory, {2: ["echo", "raise_on_1", "echo:after"]})
    with pytest.raises(AssertionError) as info:
        run("raise_on_1", 2)
    message = str(info.value)
    assert "scenario 'raise_on_1' (world size 2) raised on rank 1" in message, message
    assert "ValueError: rank 1 fails this one on purpose" in message, message
    assert [r["rank"] for r in run("echo", 2)] == [0, 1]  # before it
    assert [r["rank"] for r in run("echo:after", 2)] == [0, 1]  # and after it: still run


def test_a_rank_that_dies_keeps_what_it_finished_and_names_itself_in_the_rest(tmp_path_factory):
    run = _launch(tmp_path_factory, {2: ["echo", "die_on_1", "echo:after"]})
    assert [r["rank"] for r in run("echo", 2)] == [0, 1]
    for name in ("die_on_1", "echo:after"):
        with pytest.raises(AssertionError) as info:
            run(name, 2)
        message = str(info.value)
        assert f"scenario '{name}' (world size 2): rank 1 never finished it" in message, message
        assert "exited with 3" in message and "rank 1 exits on purpose" in message, message


def test_a_launch_past_its_timeout_ends_and_names_it(tmp_path_factory):
    run = _launch(tmp_path_factory, {2: ["echo", "sleep"]}, timeout=5)
    with pytest.raises(AssertionError, match="rank 0 never finished it; the launch ran past its 5 s"):
        run("sleep", 2)
    assert [r["rank"] for r in run("echo", 2)] == [0, 1]


@pytest.fixture
def own_servers(monkeypatch):
    """Servers of this test's own, ended after it: what it asserts does not depend on the sets other tests
    of the process left."""
    monkeypatch.setattr(forked, "_sets", collections.OrderedDict())
    yield
    forked.close_all()


def test_ranks_are_forked_by_a_server_that_imported_with_their_variables(tmp_path_factory, monkeypatch,
                                                                        own_servers):
    # HF_HOME is read when huggingface_hub is imported: the ranks' server imported it with their value
    monkeypatch.setattr(forked, "MAX_SETS", 1)
    for home in ("/hub/one", "/hub/two"):  # one set more than the process keeps: the idle one goes
        run = _launch(tmp_path_factory, {3: ["imports"]}, env={**LIGHT, "HF_HOME": home})
        got = run("imports", 3)
        assert [(r["rank"], r["forked"], r["hf_home"]) for r in got] == [(r, True, home) for r in range(3)]
        # neighbouring ranks come from the set's two servers, each with its own string-hash seed
        assert got[0]["hash"] != got[1]["hash"] and got[0]["hash"] == got[2]["hash"], got
    assert len(forked._sets) == 1


def test_ranks_that_differ_in_what_their_imports_read_start_fresh(tmp_path_factory, monkeypatch, own_servers):
    run = _launch(tmp_path_factory, {2: ["imports"]}, env=LIGHT, rank_env=lambda rank: {"HF_HOME": f"/hub/{rank}"})
    assert [(r["forked"], r["hf_home"]) for r in run("imports", 2)] == [(False, None)] * 2
    run = _launch(tmp_path_factory, {2: ["imports"]}, env=LIGHT, fork=False)
    assert [r["forked"] for r in run("imports", 2)] == [False, False]  # a launch that asked for fresh ones
    monkeypatch.setenv("SHARDCAST_TEST_FORK", "0")  # no server at all
    run = _launch(tmp_path_factory, {2: ["imports"]}, env=LIGHT)
    assert [r["forked"] for r in run("imports", 2)] == [False, False]
    assert not forked._sets
