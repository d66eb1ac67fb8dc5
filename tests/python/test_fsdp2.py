"""The real user flow, with real transformers model classes and checkpoints written by transformers'
own save_pretrained (several files), at world sizes 1-4 over c10d Gloo on a CPU mesh."""
import time

import pytest
import torch  # noqa: F401  (required: a missing one fails, never skips)
import transformers  # noqa: F401

import ranks


@pytest.fixture(scope="session")
def checkpoints(tiny_checkpoints):
    return tiny_checkpoints("rope-scaled")


def _same_error(results, kind):
    """The one message every rank raised, asserting each raised `kind` with that message."""
    assert {r["type"] for r in results} == {kind}, results
    assert len({r["message"] for r in results}) == 1, results
    return results[0]["message"]


@pytest.fixture(scope="module")
def run(fsdp2_run):
    """run(scenario, world): its per-rank results (conftest.py: fsdp2_run, one launch per world size)."""
    return fsdp2_run


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_meta_prepare_fully_shard_load_is_bit_exact(run, world):
    for rank, result in enumerate(run("flow", world)):
        assert set(result) == {"deepseek_v3", "llama", "mixtral", "qwen3_moe"}
        for model, r in result.items():
            assert r["bad"] == [], f"rank {rank} {model}: {r['bad']}"
            assert r["checked"] > 10 and r["verify"] == "ok", (model, r)
            assert "model.rotary_emb.inv_freq" in r["computed"], (model, r)
            # Only rank 0 reads the checkpoint's keys (for the fused experts); the others get them from it.
            if rank > 0:
                assert r["key_reads"] == 0, (rank, model, r["key_reads"])
            elif model != "llama":
                assert r["key_reads"] == 1, (model, r["key_reads"])


def test_rank0_failing_to_read_the_keys_is_the_same_error_on_every_rank(run):
    results = run("keys_fail", 3)
    msg = _same_error(results, "InternalError")
    assert "failed on rank 0 of 3" in msg and "index unreadable (injected)" in msg, msg


def test_rank0_freezing_while_reading_the_keys_ends_every_other_rank_with_an_error(checkpoints, tmp_path):
    # Rank 0 never publishes the compositions nor reaches the handshake: the others wait the load's
    # timeout for them (3 s), carry that into the handshake, and fail there, naming rank 0; the run
    # ends on its own (the frozen rank is killed by the harness once the others are done).
    t0 = time.monotonic()
    results = ranks.run("fsdp2_worker.py", "keys_freeze", checkpoints, 3, tmp_path, faulted=(0,), allow_fail=True,
                        timeout=120)
    survivors = results[1:]
    assert all(r is not None and r["type"] in ("CommTimeout", "CommError") for r in survivors), results
    assert all("rank 0" in r["message"] for r in survivors), survivors
    # Regression (issue 33): the store's timeout was carried as an InternalError("TimeoutError: ...").
    assert all("InternalError" not in r["message"] and "TimeoutError:" not in r["message"] for r in survivors), survivors
    assert time.monotonic() - t0 < 90


def test_explicit_mapping(run):
    for rank, r in enumerate(run("mapping", 3)):
        assert r["bad"] == [] and r["checked"] == 6, (rank, r)


def test_explicit_boxes_of_any_shape_are_bit_exact(run):
    # Uneven column blocks, overlapping boxes, ranks holding nothing, 2-d blocks leaving elements to
    # nobody: every rank holds exactly the box it declared.
    for world in (1, 3):
        results = run("mapping_boxes", world)
        for rank, r in enumerate(results):
            assert r["bad"] == [] and r["checked"] > 8 and r["verify"] == "ok", (world, rank, r)
            assert "explicit boxes" in r["mesh"], r["mesh"]


def test_a_box_outside_the_tensor_is_refused_on_every_rank(run):
    results = run("mapping_bad_box", 3)
    msg = _same_error(results, "InvalidArgument")
    assert f"key '{results[0]['key']}'" in msg and "rank 1's box reaches" in msg, msg


def test_explicit_mapping_rows_at_the_wrong_place_are_refused_on_every_rank(run):
    # Regression: the mapping form's rows were checked by length only; rows of the right length at
    # another place loaded the wrong rows, silently.
    results = run("mapping_bad_rows", 3)
    msg = _same_error(results, "InvalidArgument")
    assert f"key '{results[0]['key']}' on rank 1" in msg and "FSDP2's dim-0 rule" in msg, msg


def test_mismatch_is_the_same_exception_on_every_rank(run):
    results = run("mismatch", 3)
    msg = _same_error(results, "ManifestMismatch")
    assert "rank 1" in msg and "mlp" in msg and "shape" in msg, msg


def test_hsdp_2d_mesh_every_source(run):
    """The real fully_shard on a 2 x 2 CPU mesh (replicate x shard) over two nodes of two ranks."""
    results = run("hsdp", 4)
    want_reads = {"rank0": 1.0, "each-rank": 4.0, "node-leader": 2.0, "striped": 1.0}  # each-rank: R x 2 with verify
    for rank, result in enumerate(results):
        for case, r in result.items():
            assert r["bad"] == [], (rank, case, r["bad"])
            assert r["mesh"] == "mesh (2 x 2)" and r["nodes"] == 2 and r["verify"] == "ok", (case, r)
            assert abs(r["reads"] - want_reads[case.split("/")[1]]) < 1e-9, (case, r)


@pytest.mark.parametrize("action,kind,says", [("kill", "CommError", "is lost"), ("stop", "CommTimeout", "did not answer")])
def test_rank0_killed_or_frozen_is_the_same_exception_on_every_survivor(checkpoints, tmp_path, action, kind, says):
    """Issue 10: the store lives with rank 0; when it dies or freezes, no survivor hangs and all raise
    the same class and message naming it."""
    results = ranks.run("fsdp2_worker.py", "fault", checkpoints, 3, tmp_path, allow_fail=True, timeout=120,
                        env={"SHARDCAST_FAULT": f"0:stream:{action}:2"}, faulted=(0,))
    assert results[0] is None, "rank 0 was killed or frozen (then killed by the harness)"
    survivors = results[1:]
    assert {r["type"] for r in survivors} == {kind}, survivors
    assert len({r["message"] for r in survivors}) == 1, survivors
    assert "rank 0" in survivors[0]["message"] and says in survivors[0]["message"], survivors[0]
    assert all(r["seconds"] < 8 + 14 for r in survivors), survivors  # the worker's timeout, + teardown
