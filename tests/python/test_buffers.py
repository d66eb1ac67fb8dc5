"""Buffers and dtypes between prepare and load, against transformers' own models (issue 9 regressions):
buffer_init survives to load, a buffer with no value is one ConfigError naming all of them, the class's
fp32-kept entries stay fp32, and a rank that cannot allocate is the same error on every rank."""
import pytest

import ranks

import torch
import transformers  # noqa: F401


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    from transformers import AutoModelForCausalLM, DeepseekV3Config, Gemma3TextConfig
    root = tmp_path_factory.mktemp("buffers")
    torch.manual_seed(1)
    # both attention types, each with its own RoPE (the global one scaled, as Gemma 3's published configs)
    gemma = Gemma3TextConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=8, intermediate_size=40, vocab_size=37, sliding_window=16,
                             layer_types=["sliding_attention", "full_attention"], rope_parameters={
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})
    AutoModelForCausalLM.from_config(gemma).save_pretrained(root / "gemma3", max_shard_size="40KB")
    # DeepSeek-V3 in bf16 with its routing bias stored F32, as transformers itself keeps it.
    ds = DeepseekV3Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                          vocab_size=37, intermediate_size=48, moe_intermediate_size=16, first_k_dense_replace=1,
                          n_routed_experts=3, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                          q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                          max_position_embeddings=512, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(ds).to(torch.bfloat16)
    with torch.no_grad():
        for name, module in model.named_modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if bias is not None:  # values bf16 cannot hold exactly: rounding would show
                module.e_score_correction_bias = torch.randn(bias.shape, dtype=torch.float32) / 3
    model.save_pretrained(root / "deepseek_v3", max_shard_size="40KB")
    return root


@pytest.fixture(scope="module")
def results(models, tmp_path_factory):
    """Every scenario, in one run of two ranks: {scenario: [rank 0's result, rank 1's]}."""
    per_rank = ranks.run("buffers_worker.py", "all", models, 2, tmp_path_factory.mktemp("buffers-run"))
    return {name: [r[name] for r in per_rank] for name in per_rank[0]}


def test_buffer_init_given_to_prepare_survives_load(results):
    for rank, r in enumerate(results["gemma"]):
        assert r["bad"] == [], (rank, r)
        assert r["calls"] == ["model.embed_tokens.embed_scale", "model.rotary_emb.sliding_attention_inv_freq",
                              "model.rotary_emb.sliding_attention_original_inv_freq"], r
        assert r["logits_equal"], r["logits_max_diff"]
        assert r["verify"] == "ok"


def test_from_pretrained_passes_buffer_init_to_prepare(results):
    for rank, r in enumerate(results["gemma_pretrained"]):
        assert r["bad"] == [] and r["verify"] == "ok", (rank, r)


def test_rope_per_layer_type_and_embed_scale_need_no_buffer_init(results):
    for rank, r in enumerate(results["gemma_builtin"]):
        assert r["bad"] == [] and r["logits_equal"], (rank, r)
        assert {f"model.rotary_emb.{t}{o}_inv_freq" for t in ("sliding_attention", "full_attention")
                for o in ("", "_original")} <= set(r["buffers"]), r


@pytest.mark.parametrize("mode", ["gemma_missing", "gemma_noprepare"])
def test_a_buffer_with_no_value_is_one_config_error_naming_all(results, mode):
    rs = results[mode]
    assert {r["type"] for r in rs} == {"ConfigError"}, rs
    assert len({r["message"] for r in rs}) == 1, rs
    msg = rs[0]["message"]
    for name in ("model.alibi_slopes", "lm_head.logit_bias_table"):
        assert name in msg, msg
    assert "embed_scale" not in msg and "inv_freq" not in msg, msg  # Gemma's have built-in rules
    assert "2 non-persistent buffer(s)" in msg and "buffer_init" in msg and "prepare()" in msg, msg


def test_fp32_kept_entries_stay_fp32_as_from_pretrained_keeps_them(results):
    for r in results["deepseek_fp32"]:
        assert r["bad"] == [], r
        assert r["kept_fp32"] and all("e_score_correction_bias" in n for n in r["kept_fp32"]), r
        assert set(r["dtypes"]) == {"torch.float32"}, r


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where target='cuda' cannot allocate")
def test_a_rank_that_cannot_allocate_is_the_same_error_everywhere_at_once(results):
    rs = results["alloc_fail"]
    assert {r["type"] for r in rs} == {"IoError"}, rs
    assert len({r["message"] for r in rs}) == 1, rs
    assert "[rank 1] cannot allocate this rank's shards on cuda" in rs[0]["message"], rs[0]
    assert all(r["seconds"] < 30 for r in rs), rs  # agreed at once, not after the 60 s timeout
