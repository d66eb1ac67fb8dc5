"""The architectures of test_architectures.py beyond the ones shardcast was built around: tiny random
configs of each, written by transformers' own save_pretrained in several files (`write`). conftest.py
writes them once a session, for the launch of fsdp2_worker.py at world size 3 that test_fsdp2.py shares."""
import os


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
        # Found by an outside trial: a rename keyed by class name (GPTNeoXForCausalLM: "embed_out." ->
        # "lm_head."), MiniCPM3's embed_scale (scale_emb, not sqrt(hidden_size)), Hunyuan's "dynamic" RoPE
        # with a fixed alpha (NTK-alpha).
        "gpt_neox": t.AutoConfig.for_model("gpt_neox", intermediate_size=40, rotary_pct=0.5, **common),
        # LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini): the short factors at init
        "phi3_longrope": t.Phi3Config(intermediate_size=40, pad_token_id=0, original_max_position_embeddings=64,
                                      rope_scaling={"type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.3],
                                                    "long_factor": [2.0, 2.5, 3.0, 3.5]}, **common),
        "minicpm3": t.AutoConfig.for_model("minicpm3", intermediate_size=40, scale_emb=12, q_lora_rank=20,
                                           kv_lora_rank=12, qk_rope_head_dim=8, qk_nope_head_dim=6, v_head_dim=10,
                                           head_dim=None, **common),
        "hunyuan_v1_dense": t.AutoConfig.for_model("hunyuan_v1_dense", intermediate_size=40, head_dim=8,
                                                   rope_scaling={"type": "dynamic", "factor": 1.0, "alpha": 1000.0},
                                                   **common),
    }
    return out


def write(root):
    """Every architecture's checkpoint under ROOT/<name>, each in several files."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    for name, cfg in configs().items():
        model = AutoModelForCausalLM.from_config(cfg)
        model.save_pretrained(root / name, max_shard_size="40KB")
        assert len([f for f in os.listdir(root / name) if f.endswith(".safetensors")]) > 1, name
    return root
