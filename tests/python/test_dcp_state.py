"""shardcast.dcp's StorageWriter/StorageReader against torch's FileSystemWriter/FileSystemReader: a whole
training state (FSDP2 params, AdamW moments and steps, a LambdaLR scheduler, a dataloader's byte items)
saved at FSDP W=4 and loaded back at FSDP 4, HSDP 2x2, TP x FSDP 2x2 and FSDP 3 must equal torch's round
trip of the same state bit for bit; nothing on disk is a pickle; every failure reaches every rank (DCP's
CheckpointException carrying shardcast's exception) and none hangs. Two rank launches in all (W=4, W=3):
Python start-up dominates. The metadata codec, the value codec and the rank-file parser as hostile input,
in one process, are in test_dcp_state_files.py."""
import json
import os
import pickle

import pytest

import ranks

import torch

from shardcast.dcp._state import StorageReader


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(root, per-rank results of the W=4 launch): ROOT/sc and ROOT/fs hold the same saved state."""
    root = tmp_path_factory.mktemp("dcp-state")
    return root, ranks.run("dcp_state_worker.py", "save4", root, 4, tmp_path_factory.mktemp("out4"))


@pytest.fixture(scope="module")
def loaded3(saved, tmp_path_factory):
    root, _ = saved
    return ranks.run("dcp_state_worker.py", "load3", root, 3, tmp_path_factory.mktemp("out3"))


def _saved_full(per_rank):
    full = per_rank[0]["save"]["full"]
    assert all(r["save"]["full"] == full for r in per_rank)
    return full


@pytest.mark.parametrize("layout", ["fsdp", "hsdp", "tp"])
def test_reshard_load_equals_torch_round_trip_bit_for_bit(saved, layout):
    _, per_rank = saved
    want = _saved_full(per_rank)
    for rank, r in enumerate(per_rank):
        got = r[f"load_{layout}"]
        assert got["mismatch"] == [], f"rank {rank}: differs from torch's round trip: {got['mismatch'][:5]}"
        assert got["full"] == want, f"rank {rank}: {[k for k in want if got['full'].get(k) != want[k]][:5]}"
        assert got["keys"] == len(want) > 40


def test_reshard_load_at_three_ranks_equals_torch_round_trip(saved, loaded3):
    want = _saved_full(saved[1])
    for rank, r in enumerate(loaded3):
        assert r["load_fsdp"]["mismatch"] == [], f"rank {rank}: {r['load_fsdp']['mismatch'][:5]}"
        assert r["load_fsdp"]["full"] == want


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_async_save_writes_what_the_blocking_save_writes(saved, kind):
    """dcp.async_save with shardcast's StorageWriter as torchtitan's async checkpointing calls it (over a
    Gloo group of its own): on a thread, and in a background process that gets the writer pickled: every
    rank file byte for byte the blocking save's, and the metadata the same but for the save's own id and
    path."""
    root = saved[0]
    sync, other = root / "sc", root / f"sc-async-{kind}"
    assert sorted(os.listdir(other)) == sorted(os.listdir(sync))

    def meta(path):
        doc = json.loads((path / ".metadata.json").read_text())
        ids = doc["storage_meta"]
        assert ids.pop("checkpoint_id") == str(path) and len(ids["save_id"]) == 32
        return doc, ids.pop("save_id")
    (ours, our_id), (theirs, their_id) = meta(other), meta(sync)
    assert ours == theirs and our_id != their_id
    for name in os.listdir(sync):
        if name.endswith(".safetensors"):  # each names its own save in its header, where the ids differ alone
            mine = (other / name).read_bytes().replace(our_id.encode(), their_id.encode(), 1)
            assert our_id.encode() in (other / name).read_bytes()[:4096]
            assert mine == (sync / name).read_bytes(), name


def test_nothing_on_disk_is_a_pickle(saved):
    from safetensors import safe_open
    sc = saved[0] / "sc"
    names = sorted(os.listdir(sc))
    assert names == [".metadata.json"] + [f"__{r}_0.safetensors" for r in range(4)]
    for name in names:
        head = (sc / name).read_bytes()[:4]
        assert head[:2] != b"PK" and head[:1] != b"\x80", f"{name} is a zip or a pickle"
    json.loads((sc / ".metadata.json").read_text())
    byte_items = 0
    for name in names[1:]:
        with safe_open(str(sc / name), framework="pt") as f:  # the safetensors package reads every rank file
            for key in f.keys():
                t = f.get_tensor(key)
                if "@" not in key:  # a byte item: tagged JSON, not torch.save bytes
                    assert t.dtype == torch.uint8
                    json.loads(t.numpy().tobytes())
                    byte_items += 1
    assert byte_items > 10  # lr, betas, ..., the scheduler's fields, the dataloader's


def test_metadata_round_trips_every_field_the_planners_read(saved):
    root = saved[0]
    with open(root / "fs" / ".metadata", "rb") as f:
        theirs = pickle.load(f)  # torch's own, written by this test's ranks
    ours = StorageReader(root / "sc").read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.planner_data == theirs.planner_data
    assert set(ours.storage_data) == set(theirs.storage_data)
    assert ours.version == theirs.version
    assert ours.storage_meta.checkpoint_id == str(root / "sc")


def _failures_name(res, *words):
    assert res["type"] == "CheckpointException", res
    assert all(w in res["message"] for w in words), res["message"][:2000]


def test_truncated_rank_file_fails_on_every_rank(saved):
    _, per_rank = saved
    for r in per_rank:
        res = r["faults"]["truncated"]
        _failures_name(res, "__1_0.safetensors", "truncated")
        assert ["CheckpointError", True] in res["failures"].values()


def test_missing_rank_file_and_missing_metadata_fail_on_every_rank(saved):
    for r in saved[1]:
        _failures_name(r["faults"]["no_rank_file"], "__2_0.safetensors", "cannot open")
        _failures_name(r["faults"]["no_metadata"], ".metadata.json", "not a finished checkpoint")


def test_dtype_the_file_does_not_hold_fails_naming_key_and_file(saved):
    for r in saved[1]:
        _failures_name(r["faults"]["retyped"], "model.head.weight@", "torch.float32", "torch.int32", "__")


# Regression (fault campaign): ranks given two saves of one run (rank 1 another step's folder, or a copy with one
# rank file of another step in it) loaded a mix of both without a word. Every rank file names its save; the
# coordinator matches every rank's metadata; one CheckpointError on every rank.
def test_another_save_on_one_rank_or_in_one_file_fails_on_every_rank(saved):
    for r in saved[1]:
        _failures_name(r["faults"]["other_save"], "rank 1 read the metadata of save", "sc-async-thread",
                       "every rank must load the same checkpoint")
        _failures_name(r["faults"]["file_of_other_save"], "__1_0.safetensors", "written by save",
                       "rank file of another save")


def test_value_that_is_not_plain_data_is_refused_and_leaves_no_checkpoint(saved):
    for r in saved[1]:
        _failures_name(r["faults"]["opaque"], "dataloader.sampler", "Opaque", "allow_pickle")
        assert ".metadata.json" not in r["faults"]["opaque_left"]


def test_failed_overwrite_leaves_no_checkpoint_and_no_rank_hangs(saved):
    for r in saved[1]:
        _failures_name(r["faults"]["disk_full"], "rank 1", "__1_0.safetensors")
        assert ".metadata.json" not in r["faults"]["disk_full_left"]
