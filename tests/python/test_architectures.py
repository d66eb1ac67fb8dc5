"""More real architectures than the ones shardcast was built around: tiny random configs of each,
written by transformers' own save_pretrained (several files), loaded through the user flow (meta model,
prepare, fully_shard, load) at world size 3, where no hidden size, vocabulary or expert count divides
evenly, and compared bit for bit with transformers' own from_pretrained on every rank; then, where the
model's names are the checkpoint's keys, the same layout through dcp.load with torch's and shardcast.dcp's
HuggingFaceStorageReader, bit for bit against it; and shardcast.from_pretrained streaming beside the build.
"""
import torch  # noqa: F401  (required: a missing one fails, never skips)
import transformers  # noqa: F401

from architectures import configs

# The architectures whose layout from_pretrained predicts from the header, and so streams beside the build
# when asked: all but those whose checkpoint names transformers renames (hy_v3, phimoe, gpt_neox), which load
# after it.
BESIDE = {"gemma2", "gemma3", "gpt_oss", "hunyuan_v1_dense", "llama_tied", "minicpm3", "olmo3", "olmoe", "phi3",
          "phi3_longrope", "qwen2",
          "qwen2_moe"}


# A scenario of the W=3 launch test_fsdp2 shares (conftest.py: fsdp2_run), which saves a start-up of 3 ranks.
def test_every_architecture_is_bit_exact_at_world_size_3(fsdp2_run):
    results = fsdp2_run("flow:architectures", 3)
    for rank, result in enumerate(results):
        assert set(result) == set(configs()), result.keys()
        for model, r in result.items():
            assert r["bad"] == [], f"rank {rank} {model}: {r['bad']}"
            assert r["checked"] > 10 and r["verify"] == "ok", (model, r)
            assert r["dcp"] in ([], "keys differ"), f"rank {rank} {model}: dcp.load differs: {r['dcp']}"
        # dcp.load through torch's and shardcast's HF readers, where the model's names are the checkpoint's
        through_dcp = sorted(m for m, r in result.items() if r["dcp"] == [])
        assert {"gemma2", "gemma3", "gpt_oss", "olmo3", "phi3", "qwen2"} <= set(through_dcp), through_dcp
        # shardcast.from_pretrained streaming beside the build (its default where a node has two CPUs a
        # rank): the same shards and buffers, and beside the build wherever the header gives the layout
        for model, r in result.items():
            assert r["pretrained"]["differ"] == [], f"rank {rank} {model}: {r['pretrained']['differ']}"
        beside = sorted(m for m, r in result.items() if r["pretrained"]["beside"])
        assert set(beside) == BESIDE, " ".join(beside)
