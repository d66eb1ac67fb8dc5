"""torchtitan 0.3.0 itself (issue 31, item 6): its own Qwen3-MoE and DeepSeek-V3 models, its own
parallelize_qwen3 / parallelize_deepseekv3 and its own initial_load_in_hf step (CheckpointManager.dcp_load:
adapter.to_hf, dcp.load, adapter.from_hf, model.load_state_dict), at world 4 over Gloo on a CPU mesh, FSDP
and TP 2 x FSDP 2. Each checkpoint is loaded once through torch's HuggingFaceStorageReader (the fp8
DeepSeek-V3 one through its QuantizedHuggingFaceStorageReader, called the way torchtitan's adapter calls
it) and once through shardcast.dcp's, into identical fresh sharded models; every local shard of every
rank must be bit-identical, and torch's must equal the checkpoint (dequantized block by block for fp8).

This process writes the checkpoints; one rank launch runs every scenario with both readers in each layout.
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
    """layout -> every rank's result; one launch of 4 ranks for both layouts, shared by the tests below."""
    launch = ranks.Scenarios("dcp_torchtitan_worker.py", tmp_path_factory, {4: LAYOUTS}, root=checkpoints)
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
