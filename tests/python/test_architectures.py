"""More real architectures than the ones shardcast was built around: tiny random configs of each,
written by transformers' own save_pretrained (several files), loaded through the user flow (meta model,
prepare, fully_shard, load) at world size 3, where no hidden size, vocabulary or expert count divides
evenly, and compared bit for bit with transformers' own from_pretrained on every rank; then, where the
model's names are the checkpoint's keys, the same layout through dcp.load with torch's and shardcast.dcp's
HuggingFaceStorageReader, bit for bit against it; and shardcast.from_pretrained streaming beside the build.
"""
import os

import pytest

import ranks

import torch
import transformers  # noqa: F401

# The architectures whose layout from_pretrained predicts from the header, and so streams beside the build
# when asked: all but those whose checkpoint names transformers renames (hy_v3, phimoe), which load after it.
BESIDE = {"gemma2", "gemma3", "gpt_oss", "llama_tied", "olmo3", "olmoe", "phi3", "qwen2", "qwen2_moe"}


def configs():
    import transformers as t
    common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=37,
                  max_position_embeddings=512, tie_word_embeddings=False)
    out = {
        "llama_tied": t.LlamaConfig(intermediate_size=40, **{**common, "tie_word_embeddings": True}),
        "qwen2": t.Qwen2Config(intermediate_size=40, **common),
        "qwen2_moe": t.Qwen2MoeConfig(intermediate_size=40, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                      num_experts=5, num_experts_per_tok=2, **common),
        "phi3": t.Phi3Config(intermediate_size=40, pad_token_id=0, **common),
        "olmoe": t.OlmoeConfig(intermediate_size=16, num_experts=5, num_experts_per_tok=2, **common),
        "gpt_oss": t.GptOssConfig(intermediate_size=16, num_local_experts=5, num_experts_per_tok=2, head_dim=8,
                                  sliding_window=16, **common),
        "gemma2": t.Gemma2Config(intermediate_size=40, head_dim=8, **common),
        # One rotary module with a RoPE per attention type ("<type>_inv_freq" from rope_parameters[type]).
        "gemma3": t.Gemma3TextConfig(intermediate_size=40, head_dim=8, sliding_window=16,
                                     layer_types=["sliding_attention", "full_attention"], **common),
        "olmo3": t.AutoConfig.for_model("olmo3", intermediate_size=40, sliding_window=16, **common),
        # Checkpoint names that transformers renames with regular expressions ("mlp\\.router\\.gate\\.weight",
        # "mlp\\.expert_bias", "mlp\\.shared_mlp\\.") around fused experts; and Phi-MoE's plain renames
        # (".block_sparse_moe." -> ".mlp.", ".gate.weight" -> ".router.weight") with w1/w3/w2 experts.
        "hy_v3": t.AutoConfig.for_model("hy_v3", intermediate_size=40, moe_intermediate_size=16, num_experts=5,
                                        num_experts_per_tok=2, num_shared_experts=1, head_dim=8,
                                        mlp_layer_types=["dense", "sparse"], **common),
        "phimoe": t.PhimoeConfig(intermediate_size=16, num_local_experts=5, num_experts_per_tok=2, **common),
    }
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from transformers import AutoModelForCausalLM
    root = tmp_path_factory.mktemp("arch")
    torch.manual_seed(0)
    for name, cfg in configs().items():
        model = AutoModelForCausalLM.from_config(cfg)
        model.save_pretrained(root / name, max_shard_size="40KB")
        assert len([f for f in os.listdir(root / name) if f.endswith(".safetensors")]) > 1, name
    return root


def test_every_architecture_is_bit_exact_at_world_size_3(checkpoints, tmp_path):
    results = ranks.run("fsdp2_worker.py", "flow", checkpoints, 3, tmp_path, env={"TEST_PRETRAINED": "1"})
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
