"""ranks.Scenarios, the launcher the multi-rank tests share: one launch runs many scenarios, yet each test
still gets its own scenario's results, and a scenario that fails, or a rank that dies or hangs, fails only
the tests of the scenarios it touched, naming the scenario and the rank. Real processes (a worker without
torch, so a fresh launch takes well under a second). The ranks are forked by a server that imported torch and
transformers once, only where every rank's variables that those imports read are the server's own."""
import pytest

import ranks


def _launch(tmp_path_factory, by_world, timeout=60, env=None, rank_env=None):
    return ranks.Scenarios("scenarios_worker.py", tmp_path_factory, by_world, root="/the/root", timeout=timeout,
                           env=env, rank_env=rank_env)


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


def test_ranks_are_forked_by_a_server_that_imported_with_their_variables(tmp_path_factory):
    # HF_HOME is read when huggingface_hub is imported: the ranks' server imported it with their value
    for home in ("/hub/one", "/hub/two"):
        run = _launch(tmp_path_factory, {2: ["imports"]}, env={"HF_HOME": home})
        assert run("imports", 2) == [{"rank": r, "forked": True, "hf_home": home} for r in range(2)]


def test_ranks_that_differ_in_what_their_imports_read_start_fresh(tmp_path_factory, monkeypatch):
    run = _launch(tmp_path_factory, {2: ["imports"]}, rank_env=lambda rank: {"HF_HOME": f"/hub/{rank}"})
    assert run("imports", 2) == [{"rank": r, "forked": False, "hf_home": None} for r in range(2)]
    monkeypatch.setenv("SHARDCAST_TEST_FORK", "0")  # no server at all
    run = _launch(tmp_path_factory, {2: ["imports"]})
    assert [r["forked"] for r in run("imports", 2)] == [False, False]
