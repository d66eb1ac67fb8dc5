"""The real user flow, with real transformers model classes and checkpoints written by transformers'
own save_pretrained (several files), at world sizes 1-4 over c10d Gloo on a CPU mesh."""
import os

import pytest

import ranks

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    from transformers import (AutoModelForCausalLM, DeepseekV3Config, LlamaConfig, MixtralConfig, Qwen3MoeConfig)
    common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=37,
                  max_position_embeddings=512, tie_word_embeddings=False)
    configs = {
        "llama": LlamaConfig(intermediate_size=40, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64}, **common),
        "qwen3_moe": Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=16, head_dim=8, num_experts=5,
                                    num_experts_per_tok=2, **common),
        "mixtral": MixtralConfig(intermediate_size=40, num_local_experts=3, num_experts_per_tok=2, **common),
        "deepseek_v3": DeepseekV3Config(intermediate_size=48, moe_intermediate_size=16, first_k_dense_replace=1,
                                        n_routed_experts=3, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
                                        topk_group=1, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
                                        qk_rope_head_dim=4, v_head_dim=8,
                                        rope_scaling={"type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 128},
                                        **{**common, "num_key_value_heads": 4}),
    }
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    for name, cfg in configs.items():
        model = AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():  # persistent buffers (the routing bias) non-zero, so their load is visible
            for n, b in model.named_buffers():
                if "e_score_correction_bias" in n:
                    b.copy_(torch.randn_like(b))
        model.save_pretrained(root / name, max_shard_size="40KB")
        assert len([f for f in os.listdir(root / name) if f.endswith(".safetensors")]) > 1
    return root


def run(mode, root, world, tmp_path):
    return ranks.run("fsdp2_worker.py", mode, root, world, tmp_path)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_meta_prepare_fully_shard_load_is_bit_exact(checkpoints, tmp_path, world):
    for rank, result in enumerate(run("flow", checkpoints, world, tmp_path)):
        assert set(result) == {"deepseek_v3", "llama", "mixtral", "qwen3_moe"}
        for model, r in result.items():
            assert r["bad"] == [], f"rank {rank} {model}: {r['bad']}"
            assert r["checked"] > 10 and r["verify"] == "ok", (model, r)
            assert "model.rotary_emb.inv_freq" in r["computed"], (model, r)


def test_explicit_mapping(checkpoints, tmp_path):
    for rank, r in enumerate(run("mapping", checkpoints, 3, tmp_path)):
        assert r["bad"] == [] and r["checked"] == 6, (rank, r)


def test_explicit_mapping_rows_at_the_wrong_place_are_refused_on_every_rank(checkpoints, tmp_path):
    # Regression: the mapping form's rows were checked by length only; rows of the right length at
    # another place loaded the wrong rows, silently.
    results = run("mapping_bad_rows", checkpoints, 3, tmp_path)
    assert {r["type"] for r in results} == {"InvalidArgument"}, results
    assert len({r["message"] for r in results}) == 1, results
    msg = results[0]["message"]
    assert f"key '{results[0]['key']}' on rank 1" in msg and "FSDP2's dim-0 rule" in msg, msg


def test_mismatch_is_the_same_exception_on_every_rank(checkpoints, tmp_path):
    results = run("mismatch", checkpoints, 3, tmp_path)
    assert {r["type"] for r in results} == {"ManifestMismatch"}, results
    assert len({r["message"] for r in results}) == 1, results
    msg = results[0]["message"]
    assert "rank 1" in msg and "mlp" in msg and "shape" in msg, msg


def test_hsdp_2d_mesh_every_source(checkpoints, tmp_path):
    """The real fully_shard on a 2 x 2 CPU mesh (replicate x shard) over two nodes of two ranks."""
    world = 4
    results = ranks.run("fsdp2_worker.py", "hsdp", checkpoints, world, tmp_path,
                        rank_env=lambda r: {"LOCAL_RANK": str(r % 2), "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(r // 2)})
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
    assert all(r["seconds"] < 3 + 14 for r in survivors), survivors
