import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def build_dir() -> pathlib.Path:
    d = pathlib.Path(os.environ.get("SHARDCAST_BUILD_DIR", ROOT / "build"))
    if not (d / "tools" / "shardcast").exists():
        pytest.fail(f"no shardcast build in {d}; run tools/build.sh or set SHARDCAST_BUILD_DIR")
    return d


@pytest.fixture(scope="session")
def shardcast_bin(build_dir) -> pathlib.Path:
    return build_dir / "tools" / "shardcast"


@pytest.fixture(scope="session")
def shardcast_bench_bin(build_dir) -> pathlib.Path:
    """The benchmarks' command (bench-rss, load --source baseline, ...), apart from the shipped one."""
    exe = build_dir / "bench" / "shardcast-bench"
    if not exe.exists():
        pytest.fail(f"no {exe}; run tools/build.sh")
    return exe


def _tiny_configs(llama: str, models):
    """Tiny real transformers configs whose dims do not divide by world sizes 2-4. llama: "rope-scaled"
    (llama3 RoPE scaling, untied) or "tied" (tied embeddings)."""
    from transformers import DeepseekV3Config, LlamaConfig, MixtralConfig, Qwen3MoeConfig
    common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=37,
                  max_position_embeddings=512, tie_word_embeddings=False)
    llamas = {
        "rope-scaled": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        "tied": dict(tie_word_embeddings=True),
    }
    make = {
        "llama": lambda: LlamaConfig(intermediate_size=40, **{**common, **llamas[llama]}),
        "qwen3_moe": lambda: Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=16, head_dim=8, num_experts=5,
                                            num_experts_per_tok=2, **common),
        "mixtral": lambda: MixtralConfig(intermediate_size=40, num_local_experts=3, num_experts_per_tok=2, **common),
        "deepseek_v3": lambda: DeepseekV3Config(intermediate_size=48, moe_intermediate_size=16, first_k_dense_replace=1,
                                                n_routed_experts=3, n_shared_experts=1, num_experts_per_tok=2,
                                                n_group=1, topk_group=1, q_lora_rank=16, kv_lora_rank=8,
                                                qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                                                rope_scaling={"type": "yarn", "factor": 4.0,
                                                              "original_max_position_embeddings": 128},
                                                **{**common, "num_key_value_heads": 4}),
    }
    return {name: make[name]() for name in models}


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """make(llama, models=..., seed=0) -> a directory with one checkpoint per model, written by transformers'
    own save_pretrained in several files (40 KB shards), DeepSeek-V3's routing bias (a persistent buffer)
    random so that its load is visible. Each distinct request is written once per session; a test that
    adds to its directory must ask for a request of its own."""
    made = {}

    def make(llama: str, models=("deepseek_v3", "llama", "mixtral", "qwen3_moe"), seed: int = 0) -> pathlib.Path:
        key = (llama, tuple(models), seed)
        if key in made:
            return made[key]
        import torch
        from transformers import AutoModelForCausalLM
        root = tmp_path_factory.mktemp("hf")
        torch.manual_seed(seed)
        for name, cfg in _tiny_configs(llama, models).items():
            model = AutoModelForCausalLM.from_config(cfg)
            with torch.no_grad():
                for n, b in model.named_buffers():
                    if "e_score_correction_bias" in n:
                        b.copy_(torch.randn_like(b))
            model.save_pretrained(root / name, max_shard_size="40KB")
            assert len([f for f in os.listdir(root / name) if f.endswith(".safetensors")]) > 1, name
        made[key] = root
        return root

    return make


@pytest.fixture(scope="session")
def fsdp2_run(tiny_checkpoints, tmp_path_factory):
    """run(scenario, world): per-rank results of fsdp2_worker.py for test_fsdp2.py and test_architectures.py,
    one launch per world size for both files (rank start-up dominates). At world size 3 the architectures'
    flow ("flow:architectures", from_pretrained too) runs right after test_fsdp2's; the failing scenarios
    run last, so a leftover would show in them, not in the bit-exact checks. HSDP's two nodes of two ranks
    are its scenario's own launcher variables; the scenarios that kill or freeze ranks launch on their own."""
    import architectures
    import ranks
    checkpoints = tiny_checkpoints("rope-scaled")
    arch = architectures.write(tmp_path_factory.mktemp("arch"))

    def hsdp_nodes(rank):  # as torchrun's LOCAL_* and GROUP_RANK on two nodes of two ranks
        return {"LOCAL_RANK": str(rank % 2), "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(rank // 2)}
    return ranks.Scenarios("fsdp2_worker.py", tmp_path_factory, {
        1: ["flow", "mapping_boxes"],
        2: ["flow"],
        3: ["flow", ("flow:architectures", arch, {"TEST_PRETRAINED": "1"}), "mapping", "mapping_boxes",
            "mapping_bad_box", "mapping_bad_rows", "mismatch", "keys_fail"],
        4: ["flow", ("hsdp", checkpoints, hsdp_nodes)],
    }, root=checkpoints)
