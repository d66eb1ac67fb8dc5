"""shardcast.dcp.HuggingFaceStorageWriter behind dcp.save, against torch's own HuggingFaceStorageWriter
(save_distributed=True, enable_consolidation=True) on the same state dicts: 1-d meshes of 3 and 4 ranks with
dims that do not divide, an empty piece, Shard(1), fp8, replicated DTensors and plain tensors; a tiny real
Llama under FSDP2; a 2x2 TP x FSDP mesh. Every tensor must equal torch's and the unsharded truth byte for
byte, each byte written once, the files laid out by fqn_to_index_mapping or max_shard_size, loadable by
safetensors and from_pretrained. Then the failures (tests/python/dcp_writer_worker.py): a non-tensor item,
a mapping missing a key, one rank failing, a rank killed mid-write. One launch per world size."""
import json
import os

import pytest

import ranks

import torch


@pytest.fixture(scope="module", params=[3, 4])
def run(request, tmp_path_factory):
    world = request.param
    tmp = tmp_path_factory.mktemp(f"dcp-writer-{world}")
    per_rank = ranks.run("dcp_writer_worker.py", "all", tmp, world, tmp, allow_fail=(world == 4),
                         faulted=(1,) if world == 4 else (), timeout=600)
    saved = tmp / f"all-{world}-saved"
    return world, per_rank, saved


def tensors(d):
    """{key: tensor} of every safetensors file of the checkpoint d (the files its index names, else every one
    directly in d; a file: that file), read by safetensors."""
    from safetensors import safe_open
    if os.path.isfile(d):
        files = [d]
    elif os.path.exists(os.path.join(d, "model.safetensors.index.json")):
        files = [os.path.join(d, f) for f in sorted(set(index(d)["weight_map"].values()))]
    else:
        files = [os.path.join(d, f) for f in sorted(os.listdir(d)) if f.endswith(".safetensors")]
    out = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            for k in st.keys():
                assert k not in out, f"{k} in two files of {d}"
                out[k] = st.get_tensor(k)
    return out


def same_bytes(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def expect_equal(ours, theirs, what):
    assert sorted(ours) == sorted(theirs), what
    for k in ours:
        assert same_bytes(ours[k], theirs[k]), f"{what}: {k} ({ours[k].dtype} {list(ours[k].shape)} vs " \
                                               f"{theirs[k].dtype} {list(theirs[k].shape)})"


def index(d):
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        return json.load(f)


def survivors(per_rank, world):
    return [r for r in range(world) if not (world == 4 and r == 1)]


@pytest.mark.parametrize("name", ["dims", "dims-mapped", "llama", "tp_fsdp"])
def test_every_tensor_equals_torchs_consolidated_writer_byte_for_byte(run, name):
    world, per_rank, saved = run
    if name == "tp_fsdp" and world != 4:
        pytest.skip("a 2x2 mesh needs 4 ranks")
    for r in survivors(per_rank, world):
        assert per_rank[r] is not None and name.split("-")[0] in per_rank[r], f"rank {r} reported nothing"
    ours = tensors(saved / name)
    expect_equal(ours, tensors(saved / f"{name}-torch"), f"{name} against torch's writer")
    truth = saved / f"{name.split('-')[0]}.truth"
    expect_equal(ours, tensors(truth), f"{name} against the unsharded tensors")
    # the index names every tensor's file, and every file it names holds exactly its tensors
    weight_map = index(saved / name)["weight_map"]
    assert sorted(weight_map) == sorted(ours)
    for f in set(weight_map.values()):
        assert sorted(tensors(saved / name / f)) == sorted(k for k, v in weight_map.items() if v == f)


def test_each_byte_is_written_once_by_one_rank(run):
    world, per_rank, saved = run
    for r in survivors(per_rank, world):
        for scenario, key in (("dims", "split"), ("dims", "mapped"), ("llama", None)):
            report = per_rank[r][scenario][key] if key else per_rank[r][scenario]
            assert report["written_by_all"] == report["total_bytes"], (scenario, key, report)
    # the replicated DTensor and the plain tensor were written by one rank each: the others wrote less
    written = [per_rank[r]["dims"]["split"]["written"] for r in range(world)]  # rank 1 reported dims before the kill
    assert sum(written) == per_rank[0]["dims"]["split"]["total_bytes"]


def test_files_follow_the_mapping_or_max_shard_size(run):
    world, per_rank, saved = run
    split = per_rank[0]["dims"]["split"]["files"]
    assert len(split) > 1 and all(f.startswith("model-") for f in split)  # 1KB shards
    mapped = index(saved / "dims-mapped")["weight_map"]
    assert set(mapped.values()) == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    assert mapped["model.embed_tokens.weight"] == "model-00001-of-00002.safetensors"  # number 1 (index 0)
    assert mapped["model.layers.0.a.weight"] == "model-00002-of-00002.safetensors"  # number 2 (index 1)
    assert len(mapped) == 7
    llama = index(saved / "llama")["weight_map"]
    assert llama["model.layers.0.mlp.up_proj.weight"] == "model-00001-of-00002.safetensors"
    assert llama["model.layers.1.mlp.up_proj.weight"] == "model-00002-of-00002.safetensors"
    # what torch's writer leaves besides the checkpoint: its per-rank files (ours leaves none)
    assert index(saved / "tp_fsdp" if world == 4 else saved / "dims-mapped")  # one file: an index too, as torch's
    assert sorted(os.listdir(saved / "dims-mapped")) == ["model-00001-of-00002.safetensors",
                                                         "model-00002-of-00002.safetensors",
                                                         "model.safetensors.index.json"]
    assert not [n for n in os.listdir(saved) if ".tmp-" in n and not n.startswith("llama")]  # the kill's is llama's


def test_the_llama_loads_with_from_pretrained_and_keeps_its_config(run):
    from transformers import LlamaForCausalLM
    world, per_rank, saved = run
    d = saved / "llama"
    assert (d / "config.json").exists()  # written before the save, kept across its swap
    # the stale single file and shard were dropped with the old checkpoint; another safetensors file, the
    # user's, was kept (regression, review: every other *.safetensors at the top was dropped)
    assert not (d / "model.safetensors").exists() and not (d / "model-00003-of-00003.safetensors").exists()
    assert (d / "adapter_model.safetensors").read_text() == "adapter"
    model = LlamaForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    truth = tensors(saved / "llama.truth")
    state = model.state_dict()
    for k, v in truth.items():
        assert same_bytes(state[k], v), k


def test_placements_are_the_real_2d_ones(run):
    world, per_rank, saved = run
    if world != 4:
        pytest.skip("a 2x2 mesh needs 4 ranks")
    p = per_rank[0]["tp_fsdp"]["placements"]
    assert "Shard(dim=1)" in p["model.mlp.down_proj.weight"], p
    assert "Replicate" in p["model.mlp.down_proj.bias"], p


@pytest.mark.parametrize("case,words", [("bytes_io", ["InvalidArgument", "optimizer.step_blob", "not a tensor"]),
                                        ("unmapped", ["InvalidArgument", "model.v", "no file number"]),
                                        ("mapping_differs", ["InvalidArgument", "rank 1's fqn_to_index_mapping",
                                                             "every rank must pass the same one"]),
                                        ("mapping_text", ["InvalidArgument", "rank 1's fqn_to_index_mapping"]),
                                        ("mapping_float", ["InvalidArgument", "fqn_to_index_mapping['model.v'] = 1.7"]),
                                        ("one_rank_fails", ["cannot resolve its data", "rank 1"]),
                                        ("no_collectives", ["use_collectives=False", "err-nocoll", "no_dist=True"])])
def test_a_failure_is_raised_on_every_rank(run, case, words):
    world, per_rank, saved = run
    for r in survivors(per_rank, world):
        got = per_rank[r]["errors"][case]
        assert got["type"] is not None, f"rank {r} did not fail"
        # DCP wraps every rank's error in CheckpointException; the coordinator's planning error reaches all
        if case != "bytes_io":
            for w in words:
                assert w in got["message"], (r, got)
        else:
            assert "optimizer.step_blob" in got["message"] and "not a tensor" in got["message"], (r, got)
        assert got["seconds"] < 60
    assert per_rank[0]["errors"]["left"] == []  # nothing written, no tmp dirs


def test_a_rank_killed_mid_write_leaves_the_previous_checkpoint_and_the_next_save_works(run):
    world, per_rank, saved = run
    if world != 4:
        pytest.skip("the kill runs in the 4-rank launch")
    from dcp_writer_worker import tree_digest
    assert per_rank[1] is None or "kill" not in per_rank[1], "the killed rank finished"
    for r in (0, 2, 3):
        got = per_rank[r]["kill"]
        assert got["type"] is not None, f"rank {r} did not fail"
        assert got["seconds"] < 20 + 20 + 15, got  # shardcast's timeout, then DCP's collective over the group
    d = saved / "llama"
    assert tree_digest(d) == per_rank[0]["kill"]["before"], "the previous checkpoint changed"
    # The next save (one process) succeeds over the leftovers, removes them, and keeps config.json.
    import torch.distributed.checkpoint as dcp
    from shardcast.dcp._hf_writer import HuggingFaceStorageWriter
    truth = tensors(saved / "llama.truth")
    dcp.save(truth, storage_writer=HuggingFaceStorageWriter(d, max_shard_size="20KB"))
    expect_equal(tensors(d), truth, "the save after the kill")
    assert (d / "config.json").exists()
    assert not [n for n in os.listdir(saved) if n.startswith("llama.tmp-")]


# Regression (review): an output path that is a symlink to a directory (cluster storage often is one) failed
# with "cannot rename ... Not a directory" after every byte was written; the link is followed now.
def test_a_symlinked_output_directory_is_written_through(tmp_path):
    import torch.distributed.checkpoint as dcp
    from shardcast.dcp import HuggingFaceStorageWriter
    target = tmp_path / "storage" / "hf"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    link = tmp_path / "hf"
    link.symlink_to(target)
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    dcp.save({"w": w}, storage_writer=HuggingFaceStorageWriter(link), no_dist=True)
    assert link.is_symlink() and link.resolve() == target.resolve()
    assert sorted(os.listdir(target)) == ["config.json", "model-00001-of-00001.safetensors",
                                          "model.safetensors.index.json"]
    assert torch.equal(tensors(target)["w"], w)


# Regression (review): storage_meta had no save_id, which torch's writers give every save (DCP's async and
# staging paths and users' own bookkeeping tell saves of one path apart by it).
def test_every_save_has_its_own_save_id(tmp_path):
    from shardcast.dcp import HuggingFaceStorageWriter
    writer = HuggingFaceStorageWriter(tmp_path / "hf")
    first = writer.storage_meta()
    assert first.checkpoint_id == str(tmp_path / "hf") and first.save_id
    writer.reset(tmp_path / "hf2")
    second = writer.storage_meta()
    assert second.checkpoint_id == str(tmp_path / "hf2") and second.save_id and second.save_id != first.save_id


# Regression (review): a dtype safetensors has no code for (float8_e5m2fnuz, float4_e2m1fn_x2) was refused as
# "x: dtype has no safetensors equivalent", naming neither the dtype nor that x is a key.
def test_a_dtype_safetensors_cannot_hold_is_refused_naming_key_and_dtype(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from shardcast.dcp import HuggingFaceStorageWriter
    sd = {"model.w": torch.zeros(2, 2, dtype=torch.float8_e5m2fnuz)}
    with pytest.raises(CheckpointException,
                       match=r"key 'model.w': dtype Float8_e5m2fnuz has no safetensors equivalent"):
        dcp.save(sd, storage_writer=HuggingFaceStorageWriter(tmp_path / "hf"), no_dist=True)
    assert os.listdir(tmp_path) == []


# Regression (review): a save removed every "<path>.tmp-*" beside its path as left over by a save that died,
# also the build of another save still writing into the same path (two jobs, every rank with no_dist=True, an
# async save still running): that save then failed with "cannot open to fsync" or "cannot create".
def test_two_saves_into_one_path_at_once_both_finish(tmp_path):
    import subprocess
    import sys
    script = (  # both start saving at once, as soon as both have imported torch (each says so with a file)
        "import os, sys, time, torch, torch.distributed.checkpoint as dcp\n"
        "from shardcast.dcp import HuggingFaceStorageWriter\n"
        "sd = {f'w{i}': torch.full((128, 1024), float(i)) for i in range(16)}\n"
        "open(os.path.join(sys.argv[2], 'ready-' + sys.argv[3]), 'w').close()\n"
        "deadline = time.time() + 120\n"
        "while len([n for n in os.listdir(sys.argv[2]) if n.startswith('ready-')]) < 2 and time.time() < deadline:\n"
        "    time.sleep(0.001)\n"
        "for _ in range(6):\n"
        "    dcp.save(sd, storage_writer=HuggingFaceStorageWriter(sys.argv[1]), no_dist=True)\n")
    ready = tmp_path / "ready"
    ready.mkdir()
    procs = [subprocess.Popen([sys.executable, "-W", "ignore", "-c", script, str(tmp_path / "hf"), str(ready),
                               str(i)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-2000:] for log in logs)
    assert sorted(os.listdir(tmp_path)) == ["hf", "ready"]  # no build left beside it
    assert sorted(tensors(tmp_path / "hf")) == sorted(f"w{i}" for i in range(16))


# Regression (fault campaign): an older checkpoint's shards that were symlinks (a hub cache's snapshot) stayed
# beside the new ones after a save of fewer files (a loader globbing *.safetensors found keys twice); an empty
# path was an InternalError ("filesystem error: cannot make absolute path").
def test_old_shards_that_are_symlinks_are_replaced_and_an_empty_path_is_bad_input(tmp_path):
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.api import CheckpointException

    from shardcast.dcp import HuggingFaceStorageWriter
    out, blobs = tmp_path / "hf", tmp_path / "blobs"
    out.mkdir()
    blobs.mkdir()
    for i in range(1, 4):
        save_file({f"old{i}": torch.ones(2)}, str(blobs / f"b{i}"))
        (out / f"model-0000{i}-of-00003.safetensors").symlink_to(blobs / f"b{i}")
    (out / "adapter.safetensors").symlink_to(blobs / "b1")  # the user's: kept
    sd = {"a": torch.arange(3.0), "b": torch.ones(2)}
    dcp.save(sd, storage_writer=HuggingFaceStorageWriter(out, {"a": 1, "b": 2}), no_dist=True)
    assert sorted(os.listdir(out)) == ["adapter.safetensors", "model-00001-of-00002.safetensors",
                                       "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    with pytest.raises(CheckpointException, match="'' is not a directory to save into"):
        dcp.save(sd, storage_writer=HuggingFaceStorageWriter(""), no_dist=True)
