"""torchtitan 0.3.0 itself (issue 31, item 6): its own Qwen3-MoE and DeepSeek-V3 models, its own
parallelize_qwen3 / parallelize_deepseekv3 and its own initial_load_in_hf step (CheckpointManager.dcp_load:
adapter.to_hf, dcp.load, adapter.from_hf, model.load_state_dict), at world 4 over Gloo on a CPU mesh, FSDP
and TP 2 x FSDP 2. Each checkpoint is loaded once through torch's HuggingFaceStorageReader (the fp8
DeepSeek-V3 one through its QuantizedHuggingFaceStorageReader, called the way torchtitan's adapter calls
it) and once through shardcast.dcp's, into identical fresh sharded models; every local shard of every
rank must be bit-identical, and torch's must equal the checkpoint (dequantized block by block for fp8).

Then the training state through torchtitan's own CheckpointManager and shardcast's subclass of it
(shardcast.integrations.torchtitan): torchtitan's model, OptimizersContainer (AdamW) and
LRSchedulersContainer saved at FSDP 4, resumed at TP 2 x FSDP 2, bit for bit as torchtitan's own round
trip; and its last step in HF format.

This process writes the checkpoints; one rank launch runs every scenario with both readers in each layout,
then the training state.
Skips when torchtitan (with spmd_types and tyro, its model code's imports) is not installed.
"""
import pytest
import torch  # noqa: F401  (required: a missing one fails, never skips)

for _module in ("torchtitan.models.qwen3", "torchtitan.models.deepseek_v3"):
    pytest.importorskip(_module, exc_type=ImportError,
                        reason=f"{_module} does not import: torchtitan 0.3.0 is not installed (tools/setup.sh "
                        "installs it with --no-deps plus spmd_types and tyro, pinned in tools/constraints.txt)")

import ranks  # noqa: E402

from dcp_torchtitan_worker import LAYOUT_SCENARIOS, SCENARIOS, write  # noqa: E402

LAYOUTS = ["fsdp", "tp2fsdp2"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Written in this process (it needs no group): a rank launch of one cost its start-up, torchtitan's
    import included. The global RNG is left as it was."""
    root = tmp_path_factory.mktemp("tt_ckpt")
    with torch.random.fork_rng(devices=[]):
        written = write(str(root))
    assert set(written["scenarios"]) == set(SCENARIOS)
    return root


@pytest.fixture(scope="module")
def loaded(checkpoints, tmp_path_factory):
    """layout -> every rank's result; one launch of 4 ranks for both layouts and the training state, shared by
    the tests below."""
    launch = ranks.Scenarios("dcp_torchtitan_worker.py", tmp_path_factory, {4: LAYOUTS + ["state"]}, root=checkpoints)
    return lambda layout: launch(layout, 4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_torch_reader_loads_torchtitan_models_exactly(loaded, layout):
    for rank, result in enumerate(loaded(layout)):
        assert set(result["scenarios"]) == set(LAYOUT_SCENARIOS[layout])
        for name, by_reader in result["scenarios"].items():
            r = by_reader["torch"]
            assert r["wrong"] == [] and r["missing"] == [], (layout, rank, name, r["wrong"], r["missing"])
            assert len(r["crc"]) > 20, (layout, rank, name)
            assert r["reader_class"] and r["reader_class"][0].startswith("torch.distributed.checkpoint."), r


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shardcast_reader_gives_every_local_shard_bit_identical_to_torchs(loaded, layout):
    results = loaded(layout)
    if results[0]["no_shardcast"]:
        pytest.skip(f"shardcast.dcp is not importable: {results[0]['no_shardcast']}")
    if layout == "tp2fsdp2":  # the layout really is TP x FSDP: 2-D placements, FSDP's strided shards included
        placements = results[0]["scenarios"]["deepseek_v3"]["torch"]["placements"]
        assert "_StridedShard" in placements["layers.0.feed_forward.w1.weight"], placements
    else:  # 3 experts at FSDP 4: torchtitan shards them on dim 1
        placements = results[0]["scenarios"]["qwen3_moe_e3"]["torch"]["placements"]
        assert placements["layers.0.moe.routed_experts.inner_experts.w1_EFD"] == "(Shard(dim=1),)", placements
    for rank, result in enumerate(results):
        for name, by_reader in result["scenarios"].items():
            ours, theirs = by_reader["shardcast"], by_reader["torch"]
            assert ours["reader_class"] and ours["reader_class"][0].startswith("shardcast.dcp"), ours["reader_class"]
            assert ours["wrong"] == [] and ours["missing"] == [], (layout, rank, name, ours["wrong"])
            assert set(ours["crc"]) == set(theirs["crc"]), (layout, rank, name)
            differ = sorted(k for k in theirs["crc"] if ours["crc"][k] != theirs["crc"][k])
            assert differ == [], f"{layout} rank {rank} {name}: local shards differ from torch's reader: {differ}"


def test_training_state_through_shardcast_resumes_bit_exact_in_another_layout(loaded):
    """shardcast.integrations.torchtitan.CheckpointManager saves the state (sync at step 2, async_save at
    step 3) as safetensors + JSON; a fresh TP 2 x FSDP 2 job's load() finds the latest step and restores
    model, AdamW's moments and steps, the scheduler and the dataloader's pickled position exactly as
    torchtitan's own manager restores its own save. shardcast's manager also resumes torchtitan's own
    format (a step saved before the switch)."""
    for rank, result in enumerate(loaded("state")):
        assert result["steps"] == {"torch": 2, "shardcast": 2, "shardcast-async": 3, "shardcast-on-torch": 2}
        saved = result["saved"]
        assert any(k.endswith("exp_avg_sq") for k in saved) and "lr_scheduler" in saved and len(saved) > 100
        for name in ("torch", "shardcast", "shardcast-async", "shardcast-on-torch"):
            wrong = sorted(k for k in saved if result["whole"][name].get(k) != saved[k])
            assert wrong == [], f"rank {rank}, {name}'s resume: {wrong[:5]}"
            differ = sorted(k for k, v in result["local"]["torch"].items() if result["local"][name].get(k) != v)
            assert differ == [], f"rank {rank}, {name}'s local pieces differ from torch's round trip: {differ[:5]}"
        for name in ("shardcast", "shardcast-async"):
            files = result["files"][name]
            assert files == [".metadata.json"] + [f"__{r}_0.safetensors" for r in range(4)], files


def test_last_save_in_hf_is_the_finished_checkpoint_in_one_pass(loaded):
    """last_save_in_hf through shardcast's manager: the same tensors in the same files as torchtitan's
    (its adapter's fqn_to_index_mapping), with no per-rank 'sharded' copy beside them."""
    hf = loaded("state")[0]["hf"]
    ours, theirs = hf["shardcast"], hf["torch"]
    assert ours["tensors"] == theirs["tensors"] and len(ours["tensors"]) > 20
    assert ours["listing"] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                               "model.safetensors.index.json"], ours["listing"]
    assert "sharded" in theirs["listing"], theirs["listing"]


def test_initial_load_in_hf_through_shardcasts_manager_gives_the_checkpoint(loaded):
    """initial_load_in_hf with shardcast's manager and torchtitan's own adapter (no subclass): every
    parameter of a fresh FSDP 4 model equals the checkpoint."""
    for rank, result in enumerate(loaded("state")):
        r = result["initial_hf"]
        assert r["wrong"] == [] and len(r["checked"]) > 20, (rank, r["wrong"])


def test_folders_a_run_can_leave_are_saved_resumed_or_refused_by_name(loaded):
    """A remote folder ("file://..."), which shardcast's manager wrote to a local directory named "file:",
    is stored by torchtitan's own steps (torch's format) with a warning and resumes bit for bit; a step both
    managers saved is refused naming both metadata files (the stale shardcast save was resumed); load_step
    naming a step without its metadata gets shardcast's words (it got torch's, about a ".metadata")."""
    messages = []
    for rank, result in enumerate(loaded("state")):
        r = result["odd_folders"]
        assert ".metadata" in r["remote_files"] and not r["remote_local_dir"], (rank, r)
        assert r["remote_warned"] and r["remote_resumed"] and r["remote_equal"], (rank, r)
        assert "CheckpointError" in r["mixed"] and ".metadata.json" in r["mixed"] and "two saves" in r["mixed"], r
        assert "not a finished checkpoint" in r["partial"], (rank, r["partial"])
        messages.append(r["mixed"])
    assert len(set(messages)) == 1, messages


def test_a_torch_hf_reader_becomes_shardcasts_with_its_arguments(tmp_path):
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader
    import shardcast.dcp
    from shardcast.integrations.torchtitan import shardcast_reader
    q = shardcast_reader(QuantizedHuggingFaceStorageReader(str(tmp_path), thread_count=3, target_dtype=torch.bfloat16,
                                                           block_size=64))
    assert type(q) is shardcast.dcp.QuantizedHuggingFaceStorageReader
    assert (str(q.path), q.thread_count, q.target_dtype, q.block_size) == (str(tmp_path), 3, torch.bfloat16, 64)
    # torch's default block (which torchtitan's adapters pass) leaves the checkpoint's config to decide
    assert shardcast_reader(QuantizedHuggingFaceStorageReader(str(tmp_path))).block_size == 128
    assert "weight_block_size" not in shardcast_reader(QuantizedHuggingFaceStorageReader(str(tmp_path)))._shardcast_options
    plain = shardcast_reader(HuggingFaceStorageReader(str(tmp_path), thread_count=2))
    assert type(plain) is shardcast.dcp.HuggingFaceStorageReader
    assert (str(plain.path), plain.thread_count) == (str(tmp_path), 2)
    own = shardcast.dcp.HuggingFaceStorageReader(str(tmp_path))
    assert shardcast_reader(own) is own


def test_a_state_that_is_not_plain_data_round_trips_where_the_config_allows_pickles(loaded):
    """CheckpointManager.Config(allow_pickle=True): a user's state holding a Fraction (not plain data, which
    shardcast's writer refuses by default) comes back, beside the whole training state."""
    for rank, result in enumerate(loaded("state")):
        assert result["pickled"] == {"value": "Fraction(1, 3)", "model": True}, (rank, result["pickled"])
