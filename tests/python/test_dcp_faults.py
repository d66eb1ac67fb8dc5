"""shardcast.dcp when rank 0 fails: it reads the headers for every rank and hosts the store, so its death or
freeze is the hardest case. Killed or frozen before it answers read_metadata, killed in the middle of an HF
save or a training-state save: every other rank must end with an error within seconds (the reader's
timeout is 2 s), none may hang, and the checkpoint already at the path must not be left mixed. One rank
launch per case (a killed rank ends its launch), at W=3 on tiny files (tests/python/dcp_faults_worker.py)."""
import os

import pytest

import ranks
from dcp_writer_worker import tree_digest

import torch
from safetensors.torch import save_file

WORKER = "dcp_faults_worker.py"
WORLD = 3
SHAPES = {"a.weight": (37, 5), "b.weight": (11,), "c.weight": (6, 129)}  # as the worker's


@pytest.fixture()
def root(tmp_path):
    """ROOT/hf: a one-file HF checkpoint of SHAPES; ROOT/state: a finished shardcast training state."""
    import torch.distributed.checkpoint as dcp
    import shardcast.dcp as sdcp
    g = torch.Generator().manual_seed(3)
    full = {k: torch.randn(s, generator=g).to(torch.bfloat16) for k, s in SHAPES.items()}
    os.makedirs(tmp_path / "hf")
    save_file(full, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    dcp.save({"model": full, "step": 11}, storage_writer=sdcp.StorageWriter(str(tmp_path / "state")), no_dist=True)
    return tmp_path


def survivors(results):
    for rank in range(1, WORLD):
        r = results[rank]
        assert r is not None, f"rank {rank} wrote no result"
        assert r["error"], f"rank {rank} raised nothing although rank 0 died: {r}"
        assert r["seconds"] < 30, f"rank {rank} took {r['seconds']:.1f} s to notice: {r}"
    return [results[r] for r in range(1, WORLD)]


@pytest.mark.parametrize("action", ["kill", "stop"])
def test_rank0_lost_before_it_answers_read_metadata(root, tmp_path, action):
    results = ranks.run(WORKER, "metadata", root, WORLD, tmp_path, timeout=120, allow_fail=True, faulted=(0,),
                        env={"SHARDCAST_FAULT": f"0:metadata:{action}"})
    for r in survivors(results):
        # The reader raises on its own, within its 2 s timeout (+ a few s for a store that does not answer):
        # CommError for a store that is gone, CommTimeout for one that is frozen. DCP then raises its own
        # error when its gather to rank 0 fails (its group's 3 s timeout when rank 0 is frozen).
        cls, message, seconds = r["read_metadata"]
        assert cls in ({"CommTimeout"} if action == "stop" else {"CommError", "CommTimeout"}), r
        assert "rank 0" in message and seconds < 10, r


def test_rank0_killed_mid_hf_save_leaves_the_checkpoint(root, tmp_path):
    before = tree_digest(root / "hf")
    results = ranks.run(WORKER, "hf-save", root, WORLD, tmp_path, timeout=120, allow_fail=True, faulted=(0,),
                        env={"SHARDCAST_FAULT": "0:save-write:kill:2"})
    assert results[0] is None  # it died
    survivors(results)
    assert tree_digest(root / "hf") == before


def test_rank0_killed_mid_state_save_leaves_no_mixed_checkpoint(root, tmp_path):
    import torch.distributed.checkpoint as dcp
    import shardcast.dcp as sdcp
    from shardcast import CheckpointError
    results = ranks.run(WORKER, "state-save", root, WORLD, tmp_path, timeout=120, allow_fail=True, faulted=(0,),
                        env={"SHARDCAST_FAULT": "0:save-write:kill:2"})
    assert results[0] is None
    survivors(results)
    # The overwrite removed the old metadata before any rank wrote: no checkpoint, rather than a mixed one.
    with pytest.raises(CheckpointError, match="not a finished checkpoint"):
        sdcp.StorageReader(str(root / "state")).read_metadata()
    state = {"model": {k: torch.empty(s, dtype=torch.bfloat16) for k, s in SHAPES.items()}, "step": 0}
    with pytest.raises(BaseException, match="not a finished checkpoint"):
        dcp.load(state, storage_reader=sdcp.StorageReader(str(root / "state")), no_dist=True)


def test_a_rank_file_that_shrinks_after_it_was_opened_is_an_error_not_a_crash(root):
    """The training-state reader validates a rank file's header when it opens it, then reads. A file cut
    between the two (another job rewriting the directory) must raise CheckpointError naming it: a mapping
    would have killed the process with SIGBUS."""
    from shardcast import CheckpointError
    from shardcast.dcp._state_files import _copy_box, _RankFile
    path = root / "state" / "__0_0.safetensors"
    f = _RankFile(str(path), 1 << 20)
    try:
        dtype, shape, begin, end = f.entries[max(f.entries, key=lambda k: f.entries[k][2])]  # the last tensor
        whole = torch.empty(shape, dtype=dtype)
        _copy_box(f, f.data_start + begin, dtype, shape, [0] * len(shape), shape, whole, 64, "the last tensor")
        with open(path, "r+b") as fh:
            fh.truncate(f.data_start + begin + (end - begin) // 2)
        for block_bytes in (64, 1 << 20):  # staged blocks, and one read straight into the destination
            with pytest.raises(CheckpointError, match=r"__0_0\.safetensors.*the last tensor.*bytes short"):
                _copy_box(f, f.data_start + begin, dtype, shape, [0] * len(shape), shape,
                          torch.empty(shape, dtype=dtype), block_bytes, "the last tensor")
        window = [1] + list(shape[1:])  # a box that is not whole rows: staged
        if len(shape) > 1 and shape[1] > 1:
            window[1] = shape[1] - 1
            with pytest.raises(CheckpointError, match="bytes short"):
                _copy_box(f, f.data_start + begin, dtype, shape, [shape[0] - 1] + [1] + [0] * (len(shape) - 2),
                          window, torch.empty(window, dtype=dtype), 64, "the last tensor")
    finally:
        f.close()
