"""shardcast.dcp.HuggingFaceStorageReader and QuantizedHuggingFaceStorageReader against torch's own readers,
called the way DCP users call them: `dcp.load(state_dict, storage_reader=...)` over real Gloo ranks.

Each world size is one launch running every scenario of dcp_reader_worker.py (DTensor boxes in every
layout, a fully_shard'ed transformers model, fp8 and MXFP4 dequantized in the stream, the metadata, torch's
per-rank files of save_distributed=True), each
rank comparing its local shards bit for bit; at world 3 it then reads a copy truncated on one rank, which
must end every rank with the same error. A rank killed mid-stream has a launch of its own.
"""
import json
import os
import shutil

import pytest
import torch

import ranks

WORKER = "dcp_reader_worker.py"


def _fp8_blocks(w: torch.Tensor, block: int = 128):
    """(fp8 weight, fp32 scale_inv grid) of w quantized per block x block tile, as DeepSeek-V3 stores it."""
    rows, cols = w.shape
    gr, gc = -(-rows // block), -(-cols // block)
    scale = torch.empty(gr, gc)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(gr):
        for j in range(gc):
            tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            s = tile.abs().max().clamp(min=1e-6) / 448.0
            scale[i, j] = s
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / s).to(torch.float8_e4m3fn)
    return q, scale


def _write_quantized(path):
    """Two files: fp8 weights (200 x 300 cuts a 128-block both ways; one weight's scale lives in the other
    file), a bf16 norm, an MXFP4 pair blocks [E=3, out=5, G=2, 16] / scales [3, 5, 2], and an NVFP4 triple."""
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(3)
    a, b = {}, {}
    for name, shape, where in (("layers.0.q_proj", (200, 300), a), ("layers.0.o_proj", (130, 96), a),
                               ("layers.1.q_proj", (257, 129), b)):
        q, s = _fp8_blocks(torch.randn(*shape, generator=g))
        where[f"{name}.weight"] = q
        (b if name == "layers.0.o_proj" else where)[f"{name}.weight_scale_inv"] = s
    a["layers.0.norm.weight"] = torch.randn(300, generator=g).to(torch.bfloat16)
    b["experts.down_proj_blocks"] = torch.randint(0, 256, (3, 5, 2, 16), dtype=torch.uint8, generator=g)
    b["experts.down_proj_scales"] = torch.randint(118, 134, (3, 5, 2), dtype=torch.uint8, generator=g)
    # NVFP4 (ModelOpt): 37 x 48 packed in [37, 24], E4M3 scales per 16, a global scale; values and scales
    # in different files
    a["layers.2.nv.weight"] = torch.randint(0, 256, (37, 24), dtype=torch.uint8, generator=g)
    b["layers.2.nv.weight_scale"] = torch.randint(0x01, 0x7F, (37, 3), dtype=torch.uint8,
                                                  generator=g).view(torch.float8_e4m3fn)
    b["layers.2.nv.weight_scale_2"] = torch.tensor(0.37, dtype=torch.float32)
    os.makedirs(path)
    files = {"model-00001-of-00002.safetensors": a, "model-00002-of-00002.safetensors": b}
    weight_map = {}
    for name, tensors in files.items():
        save_file(tensors, os.path.join(path, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
    import json
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


@pytest.fixture(scope="module")
def root(tiny_checkpoints, tmp_path_factory):
    src = tiny_checkpoints("rope-scaled", models=("llama",))
    root = tmp_path_factory.mktemp("dcp")
    shutil.copytree(src / "llama", root / "llama")
    _write_quantized(str(root / "quantized"))
    return root


def _copies(root, name):
    """ROOT/<name>-<rank>/llama, a copy of the llama for each of 3 ranks: rank 1's, for the fixture to change."""
    for r in range(3):
        shutil.copytree(root / "llama", root / f"{name}-{r}" / "llama", dirs_exist_ok=True)
    return root / f"{name}-1" / "llama"


@pytest.fixture(scope="module")
def truncated(root):
    """ROOT/copy-<rank>/llama for 3 ranks, a copy of the llama each, rank 1's first file truncated: the file."""
    victim = sorted(p for p in _copies(root, "copy").iterdir() if p.suffix == ".safetensors")[0]
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) - 100)
    return victim


@pytest.fixture(scope="module")
def other_values(root):
    """ROOT/values-<rank>/llama for 3 ranks, rank 1's first file with its last 64 bytes changed (its header
    kept): the file."""
    victim = sorted(p for p in _copies(root, "values").iterdir() if p.suffix == ".safetensors")[0]
    data = bytearray(victim.read_bytes())
    data[-64:] = bytes(b ^ 0xFF for b in data[-64:])
    victim.write_bytes(bytes(data))
    return victim


@pytest.fixture(scope="module")
def unsampled(root):
    """ROOT/unsampled-<rank>/llama for 3 ranks, rank 1's largest file with every byte of one tensor changed (so
    rank 1 reads some of them in any layout), a tensor lying where the handshake's samples (the data's first,
    middle and last 4 KiB) do not look: the file."""
    victim = max((p for p in _copies(root, "unsampled").iterdir() if p.suffix == ".safetensors"),
                 key=os.path.getsize)
    data = bytearray(victim.read_bytes())
    n = int.from_bytes(data[:8], "little")
    start, size = 8 + n, len(data) - 8 - n
    sampled = [(0, 4096), ((size - 4096) // 2, (size + 4096) // 2), (size - 4096, size)]
    spans = [tuple(t["data_offsets"]) for k, t in json.loads(data[8:start]).items() if k != "__metadata__"]
    free = [(b, e) for b, e in spans if e > b and all(e <= sb or b >= se for sb, se in sampled)]
    assert free, "no tensor of the file lies outside the samples"
    b, e = free[0]
    data[start + b:start + e] = bytes(x ^ 0xFF for x in data[start + b:start + e])
    victim.write_bytes(bytes(data))
    return victim


@pytest.fixture(scope="module")
def resized(root):
    """ROOT/resized-<rank>/llama for 3 ranks, rank 1's the same keys in float32 (files and index of other
    sizes): its directory."""
    from safetensors.torch import load_file, save_file
    victim = _copies(root, "resized")
    for f in victim.iterdir():
        if f.suffix == ".safetensors":
            save_file({k: v.float() if v.is_floating_point() else v for k, v in load_file(str(f)).items()}, str(f))
    index = victim / "model.safetensors.index.json"
    meta = json.loads(index.read_text())
    meta.setdefault("metadata", {})["total_size"] = sum(f.stat().st_size for f in victim.iterdir()
                                                        if f.suffix == ".safetensors")
    index.write_text(json.dumps(meta, indent=4))
    return victim


@pytest.fixture(scope="module")
def unindexed(root):
    """ROOT/unindexed-<rank>/llama for 3 ranks, rank 1's without model.safetensors.index.json and its last
    file: that file."""
    victim = _copies(root, "unindexed")
    (victim / "model.safetensors.index.json").unlink()
    missing = sorted(p for p in victim.iterdir() if p.suffix == ".safetensors")[-1]
    missing.unlink()
    return missing


@pytest.fixture(scope="module")
def blocks120(root):
    """ROOT/blocks120: one fp8 weight (300 x 300, cut by 120-blocks both ways) quantized in 120 x 120 blocks,
    its scale grid [3, 3] as 128-blocks would also need, and no config.json to say which."""
    from safetensors.torch import save_file
    w = torch.randn(300, 300, generator=torch.Generator().manual_seed(5))
    q, s = _fp8_blocks(w, block=120)
    os.makedirs(root / "blocks120", exist_ok=True)
    name = "model-00001-of-00001.safetensors"  # and an index: torch's quantized reader reads it
    save_file({"w.weight": q, "w.weight_scale_inv": s}, str(root / "blocks120" / name))
    (root / "blocks120" / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"w.weight": name, "w.weight_scale_inv": name}}))
    return root / "blocks120"


@pytest.fixture(scope="module")
def run(root, truncated, other_values, unsampled, resized, unindexed, blocks120, tmp_path_factory):
    """run(scenario, world): its per-rank results, one launch per world size (rank start-up dominates)."""
    return ranks.Scenarios(WORKER, tmp_path_factory, {3: ["compare", "truncated", "other_values", "groups",
                                                          "block_size", "copies_verify", "other_size", "unindexed"],
                                                      4: ["compare"]}, root=root)


@pytest.mark.parametrize("world", [3, 4])
def test_dcp_load_equals_torch_readers_bit_for_bit(run, world):
    results = run("compare", world)
    for rank, r in enumerate(results):
        assert "crash" not in r, f"rank {rank}:\n{r['crash']}"
        assert r["problems"] == [], f"rank {rank}: {r['problems']}"
        assert r["checked"]["boxes"] > 10 and r["checked"]["fsdp"] > 10 and r["checked"]["quantized"] == 12
        assert r["checked"]["per_rank"] > 10 and r["checked"]["alone"] > 10


def test_truncated_copy_on_one_rank_fails_every_rank(run, truncated):
    victim = truncated
    results = run("truncated", 3)
    errors = [r.get("error") or r.get("crash") for r in results]
    assert all(errors), errors
    # DCP reports each rank's failure in its CheckpointException; each is the one agreed shardcast error,
    # naming the file and rank 1, the same on every rank.
    agreed = [r["shardcast"] for r in results]
    assert agreed[0] and all(a == agreed[0] for a in agreed), agreed
    assert any(victim.name in line and "rank 1" in line for line in agreed[0]), agreed[0]


def test_a_rank_given_another_checkpoint_with_the_same_headers_fails_every_rank(run, other_values):
    """Each rank names its own copy by a path of its own; rank 1's holds other values under the same headers
    (another step of the run). It once loaded a mix of both (each-rank), or, its path not rank 0's, waited
    for rank 0's headers under its own path until the timeout; now the same error on every rank, at once."""
    results = run("other_values", 3)
    assert all(r.get("error") for r in results), results
    agreed = [r["shardcast"] for r in results]
    assert agreed[0] and all(a == agreed[0] for a in agreed), agreed
    assert any(other_values.name in line and "data differs between rank 0 and rank 1" in line for line in agreed[0])
    assert all(r["seconds"] < 15 for r in results), [r["seconds"] for r in results]


def test_a_rank_seeing_another_checkpoint_of_other_sizes_fails_every_rank(run, resized):
    """source auto, rank 1's path holding another checkpoint (float32 weights: its files and index of other
    sizes): it was taken as a rank that does not see the checkpoint and served rank 0's values, unseen; now
    it reads its own, and the handshake's file match refuses it: one ManifestMismatch on every rank naming
    rank 1 and both sizes (source=rank0, asked for, still serves rank 0's)."""
    results = run("other_size", 3)
    assert all(r.get("error") for r in results), results
    agreed = [r["shardcast"] for r in results]
    assert agreed[0] and all(a == agreed[0] for a in agreed), agreed
    assert any(line.startswith("ManifestMismatch") and "bytes on rank 0 but" in line and "on rank 1" in line
               for line in agreed[0]), agreed


def test_a_rank_whose_copy_lacks_the_index_is_served_by_rank0_or_refused_by_name(run, unindexed):
    """Regression: rank 1's copy without its index was, to rank 1 alone, a directory to read file by file, so
    it planned other read rounds than rank 0 and every rank failed with an InternalError about "read rounds"
    that named no file. The choice is rank 0's now: under source auto rank 0 serves rank 1 (torch's values on
    every rank), and under each-rank every rank fails at once with one error naming rank 1 and the file."""
    results = run("unindexed", 3)
    for rank, r in enumerate(results):
        assert r["problems"] == [] and r["checked"] > 10, f"rank {rank}: {r}"
        assert r["source"] == "rank0", f"rank {rank}: {r}"
    agreed = [r["shardcast"] for r in results]
    assert agreed[0] and all(a == agreed[0] for a in agreed), agreed
    assert any("rank 1" in line and unindexed.name in line and "no such file" in line for line in agreed[0]), agreed[0]
    assert all(r["seconds"] < 20 for r in results), [r["seconds"] for r in results]


def test_copies_that_differ_where_no_sample_looks_fail_verify_as_a_checkpoint_error(run, unsampled):
    """Rank 1's copy differs a quarter into one file, which the handshake's samples pass: verify=True (each
    rank hashing what it read, its neighbour reading the same bytes from its own copy) finds it, one
    CheckpointError on every rank saying the copies differ (it was a CommError about checksums)."""
    results = run("copies_verify", 3)
    assert all(r.get("error") for r in results), results
    agreed = [r["shardcast"] for r in results]
    assert agreed[0] and all(a == agreed[0] for a in agreed), agreed
    assert all(line.startswith("CheckpointError") and "copies of it differ" in line for line in agreed[0]), agreed


def test_block_size_is_the_checkpoints_where_no_config_says_and_every_rank_gives_the_same(run):
    """A checkpoint quantized in 120-blocks with no config.json: block_size=120 was ignored (128 used, 13,824
    of 90,000 values wrong, no error); it now equals torch's reader bit for bit. A block_size that differs
    between ranks is one ManifestMismatch on every rank naming both."""
    results = run("block_size", 3)
    for r in results:
        assert "crash" not in r, r["crash"]
        assert r["checked"] == 1 and r["problems"] == [], r
    agreed = [r["shardcast"] for r in results]
    assert agreed[0] and all(a == agreed[0] for a in agreed), agreed
    assert any("the agreed fp8 block is 120x120" in line and "rank 1 asked for 128x128" in line
               for line in agreed[0]), agreed


def test_no_dist_and_subgroup_loads_need_no_reader_told_the_group(run):
    """Regression (review): under dcp.load(no_dist=True) on a rank other than 0, or over a subgroup without
    rank 0 that only dcp.load was given, the reader waited for rank 0's headers until its timeout."""
    results = run("groups", 3)
    for rank, r in enumerate(results):
        assert "crash" not in r, f"rank {rank}:\n{r['crash']}"
        assert r["problems"] == [], f"rank {rank}: {r['problems']}"
        assert all(s < 20 for s in r["seconds"].values()), f"rank {rank}: {r['seconds']}"
    assert "no_dist on the last rank" in results[2]["seconds"] and "subgroup save" in results[1]["seconds"]


def test_a_storage_layer_given_another_group_on_one_rank_fails_every_rank_at_once(run):
    """Regression: a reader given a group of one on rank 0 alone (DCP over all 3 ranks) exchanged the headers
    over that group while the others waited for them on DCP's, and a writer given one on the last rank alone
    met the others in no save: every rank waited out the timeout (20 s here, 10 minutes by default) and no
    error said why. Now each is one error on every rank within seconds, naming both group sizes."""
    results = run("groups", 3)
    for what in ("reader", "writer"):
        told = [r["mismatched"][what] for r in results]
        assert all(seconds < 10 for seconds, _ in told), (what, told)
        assert told[0][1] and all(errors == told[0][1] for _, errors in told), (what, told)
        assert all("a group of 3 ranks" in line and "given a process_group of 1" in line for line in told[0][1]), told
    # DCP re-raises a read_metadata failure as its AssertionError carrying the message; the writer's is as is
    assert all(line.startswith("InvalidArgument") for line in results[0]["mismatched"]["writer"][1])


def test_rank_killed_mid_stream_ends_every_rank(root, tmp_path):
    world = 3
    results = ranks.run(WORKER, "kill", root, world, tmp_path, timeout=120, allow_fail=True, faulted=(1,),
                        env={"SHARDCAST_FAULT": "1:stream:kill:1"})
    assert results[1] is None
    for rank in (0, 2):  # shardcast's group, or DCP's own collective after it, reports the lost peer
        assert results[rank]["error"], results[rank]
        # DCP's gather after the failed read raises Gloo's bare "Connection closed by peer" in place of the
        # reader's agreed error: the reader logs that one first, naming the rank lost (outside trial: the
        # writer's "rank 0 had committed <dir>" was seen nowhere).
        logged = results[rank].get("logged", [])
        assert any(line.startswith("dcp read_data: Comm") and "rank 1" in line for line in logged), results[rank]


# -- per-rank files as hostile or unusual input, in this process (a world of one) ---------------------------

def _per_rank_files(path, pieces):
    """torch's per-rank file layout by hand: one file per piece of "w", placed by DCP_SHARDING_INFO."""
    import json
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    for i, (tensor, offsets) in enumerate(pieces, 1):
        save_file({"w": tensor.contiguous()}, os.path.join(path, f"shard-{i:05d}-model-00001-of-00001.safetensors"),
                  metadata={"DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": offsets}})})


@pytest.fixture
def world_of_one():
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# Regression (review): two read items of one key from the same file (a rank holding two local shards that
# overlap one piece) were one round, and the second overwrote the first: part of the destination was left
# as it was, with no error.
def test_per_rank_files_into_several_local_shards_of_a_key(tmp_path, world_of_one):
    import torch.distributed.checkpoint  # noqa: F401 -- its HuggingFaceStorageReader
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.sharded_tensor import Shard as STShard, ShardMetadata, init_from_local_shards
    import shardcast.dcp as sdcp
    full = torch.arange(16.).reshape(8, 2)
    _per_rank_files(tmp_path, [(full[:4], [0, 0]), (full[4:], [4, 0])])
    got = {}
    for name, reader in (("torch", torch.distributed.checkpoint.HuggingFaceStorageReader), ("shardcast", sdcp.HuggingFaceStorageReader)):
        shards = [STShard(torch.full((2, 2), -1.), ShardMetadata([0, 0], [2, 2], "rank:0/cpu")),
                  STShard(torch.full((2, 2), -1.), ShardMetadata([2, 0], [2, 2], "rank:0/cpu")),
                  STShard(torch.full((4, 2), -1.), ShardMetadata([4, 0], [4, 2], "rank:0/cpu"))]
        st = init_from_local_shards(shards, 8, 2)
        dcp.load({"w": st}, storage_reader=reader(str(tmp_path)))
        got[name] = [s.tensor.clone() for s in st.local_shards()]
    assert all(torch.equal(a, b) for a, b in zip(got["torch"], got["shardcast"])), got
    assert torch.equal(torch.cat(got["shardcast"]), full)


# Regression (review): pieces were checked by volume only, so a hole beside an overlap passed and the hole
# kept the destination's old values.
@pytest.mark.parametrize("pieces,words", [
    ([(torch.zeros(2, 1), [0, 0]), (torch.zeros(1, 2), [1, 0])], "overlap"),
    ([(torch.zeros(2, 2), [0, 0]), (torch.zeros(2, 2), [4, 0])], "hold 8 of its 12 elements"),
    ([(torch.zeros(2, 2), [0, 0]), (torch.zeros(2, 2, dtype=torch.float16), [2, 0])], "dtypes"),
])
def test_per_rank_pieces_that_do_not_fill_a_key_exactly_once_are_refused(tmp_path, pieces, words):
    import shardcast
    import shardcast.dcp as sdcp
    _per_rank_files(tmp_path, pieces)
    with pytest.raises(shardcast.CheckpointError, match=f"key 'w': its pieces .* exactly once: .*{words}"):
        sdcp.HuggingFaceStorageReader(str(tmp_path)).read_metadata()


# Regression (review): a directory with neither an index nor model.safetensors (an adapter, a sharded model
# whose index is missing) was refused, where torch's reader reads every safetensors file in it.
def test_a_directory_without_an_index_is_read_file_by_file_as_torch_reads_it(tmp_path):
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    import shardcast
    import shardcast.dcp as sdcp
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(5, 3, generator=g).to(torch.bfloat16), torch.randn(7, generator=g)
    save_file({"a": a}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": b}, str(tmp_path / "model-00002-of-00002.safetensors"))
    got = {}
    for name, reader in (("torch", torch.distributed.checkpoint.HuggingFaceStorageReader),
                         ("shardcast", sdcp.HuggingFaceStorageReader)):
        out = {"a": torch.zeros(5, 3, dtype=torch.bfloat16), "b": torch.zeros(7)}
        dcp.load(out, storage_reader=reader(str(tmp_path)), no_dist=True)
        got[name] = out
    assert torch.equal(got["shardcast"]["a"], a) and torch.equal(got["shardcast"]["b"], b)
    assert all(torch.equal(got["torch"][k], got["shardcast"][k]) for k in ("a", "b"))
    save_file({"b": b}, str(tmp_path / "adapter_model.safetensors"))  # "b" twice: which one is meant?
    with pytest.raises(shardcast.CheckpointError, match="key 'b': its pieces .* overlap"):
        sdcp.HuggingFaceStorageReader(str(tmp_path)).read_metadata()


# Regression (review): a complex64 tensor (torchtitan's freqs_cis buffer, RoPE tables) written by shardcast's
# HuggingFaceStorageWriter as safetensors' C64 was refused by its reader ("dtype C64 has no torch
# equivalent"), where torch's reader reads it.
def test_complex64_round_trips_through_the_hf_writer_and_both_readers(tmp_path):
    import torch.distributed.checkpoint as dcp
    import shardcast.dcp as sdcp
    g = torch.Generator().manual_seed(4)
    z = torch.complex(torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g))
    dcp.save({"freqs_cis": z}, storage_writer=sdcp.HuggingFaceStorageWriter(str(tmp_path)), no_dist=True)
    for reader in (torch.distributed.checkpoint.HuggingFaceStorageReader, sdcp.HuggingFaceStorageReader):
        out = {"freqs_cis": torch.zeros(6, 4, dtype=torch.complex64)}
        dcp.load(out, storage_reader=reader(str(tmp_path)), no_dist=True)
        assert torch.equal(out["freqs_cis"], z), reader
