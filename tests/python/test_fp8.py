"""fp8 checkpoints into bf16 shards, against torch and transformers (issue 11): the reader dequantizes
each weight with its block scales; every rank's rows are bit-identical to torch's formula, and a
FSDP2 model's parameters to transformers' own dequantized load, fused experts included."""
import json
import subprocess

import pytest

import ranks

import torch
import transformers  # noqa: F401

# A DeepSeek-V3 whose quantized weights divide the 128 x 128 block (transformers refuses the others).
DEEPSEEK_FP8 = {
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 2,
    "hidden_size": 256, "intermediate_size": 384, "moe_intermediate_size": 128, "num_attention_heads": 2,
    "num_key_value_heads": 2, "q_lora_rank": 256, "kv_lora_rank": 64, "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 64, "v_head_dim": 64, "n_routed_experts": 3, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "vocab_size": 101,
    "max_position_embeddings": 512, "rope_theta": 10000, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, shardcast_bin):
    from safetensors.torch import save_file
    root = tmp_path_factory.mktemp("fp8")
    cfg = root / "deepseek.json"
    cfg.write_text(json.dumps(DEEPSEEK_FP8))
    subprocess.run([str(shardcast_bin), "synth", "--config", str(cfg), "--out", str(root / "deepseek_fp8"),
                    "--max-shard-size", "1M", "--seed", "3"], check=True, capture_output=True, timeout=300)
    # Odd shapes: rows that do not divide the block (partial bottom blocks), shards starting mid-block,
    # and every scale dtype.
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name, (r, c), scale_dtype in (("a.weight", (576, 7168), torch.float32), ("b.weight", (200, 96), torch.bfloat16),
                                      ("c.weight", (200, 96), torch.float16),
                                      ("d.weight", (130, 300), torch.float8_e8m0fnu),
                                      ("e.weight", (3, 200), torch.float32)):  # W=4: a zero-row rank
        w = (torch.randn(r, c, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        grid = (-(-r // 128), -(-c // 128))
        s = torch.exp2(torch.randint(-14, -6, grid, generator=g).float()) * (1 + torch.rand(grid, generator=g))
        tensors[name], tensors[name + "_scale_inv"] = w, s.to(scale_dtype)
    (root / "odd").mkdir()
    save_file(tensors, str(root / "odd" / "model.safetensors"))
    write_e8m0_twins(root / "deepseek_fp8", root)
    plain = {k: v for k, v in DEEPSEEK_FP8.items() if k != "quantization_config"}
    (root / "bf16.json").write_text(json.dumps(plain))
    subprocess.run([str(shardcast_bin), "synth", "--config", str(root / "bf16.json"), "--out", str(root / "bf16"),
                    "--seed", "3"], check=True, capture_output=True, timeout=300)
    return root


def write_e8m0_twins(src, root):
    """The DeepSeek-V3 fp8 checkpoint with E8M0 scales ("scale_fmt": "ue8m0", as DeepSeek-V3.1 and
    MXFP8 checkpoints ship): each scale grid replaced by powers of two 2^(b - 127), b in [112, 124],
    stored as F8_E8M0 tensors (deepseek_e8m0) and as the uint8 bytes b (deepseek_u8)."""
    import shutil
    from safetensors.torch import load_file, save_file
    g = torch.Generator().manual_seed(5)
    for name, dtype in (("deepseek_e8m0", torch.float8_e8m0fnu), ("deepseek_u8", torch.uint8)):
        dst = root / name
        shutil.copytree(src, dst)
        for f in sorted(dst.glob("*.safetensors")):
            tensors = load_file(str(f))
            for k, v in tensors.items():
                if k.endswith("_scale_inv"):
                    b = torch.randint(112, 125, v.shape, generator=g, dtype=torch.uint8)
                    tensors[k] = b.view(torch.float8_e8m0fnu) if dtype != torch.uint8 else b
            save_file(tensors, str(f), metadata={"format": "pt"})
        config = json.loads((dst / "config.json").read_text())
        config["quantization_config"]["scale_fmt"] = "ue8m0"
        (dst / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def run(checkpoints, tmp_path_factory):
    """run(scenario, world): its per-rank results, from one launch per world size (rank start-up dominates)."""
    return ranks.Scenarios("fp8_worker.py", tmp_path_factory, {
        1: ["all", "e8m0", "kept"], 2: ["all", "kept", "refusals"], 3: ["all", "e8m0", "kept"], 4: ["all"]},
        root=checkpoints)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_rank_equals_torch_and_transformers(run, world):
    results = run("all", world)
    assert all("transformers" in r for r in results) == (2 <= world <= 3)
    for rank, r in enumerate(results):
        # Odd shapes, both sources: each rank's rows equal torch's formula.
        for source in ("rank0", "each-rank"):
            m = r["mapping"][source]
            assert m["bad"] == [], (rank, source, m)
            assert m["dequantized"] == 5 and m["checked"] == 5, m
        if "transformers" not in r:
            continue
        # A FSDP2 DeepSeek-V3: every parameter equals transformers' own dequantized load.
        t = r["transformers"]
        assert t["bad"] == [], (rank, t["bad"])
        assert t["fused"], "the model has fused experts (one part per expert, each with its own scale)"
        assert t["dequantized"] > 10 and t["verify"] == "ok", t
        # shardcast.from_pretrained of the fp8 checkpoint: the same bf16 parameters.
        assert t["from_pretrained_bad"] == [], (rank, t["from_pretrained_bad"])
        assert t["from_pretrained_dequantized"] == t["dequantized"], t
        # No source given and none in the environment: auto, and every rank here sees the files on one node.
        assert t["from_pretrained_source"] == ["each-rank", "auto: every rank sees the checkpoint, on one node"], t


@pytest.mark.parametrize("world", [1, 3])
def test_e8m0_scales_equal_transformers(run, world):
    """fp8 with E8M0 scales goes through the same path as F32 scales: F8_E8M0 tensors and uint8 exponent
    bytes alike, every parameter bit-exact against transformers' own dequantized load."""
    results = run("e8m0", world)
    for rank, r in enumerate(results):
        for name, t in r["e8m0"].items():
            assert t["bad"] == [] and t["from_pretrained_bad"] == [], (rank, name, t["bad"], t["from_pretrained_bad"])
            assert t["dequantized"] > 10 and t["verify"] == "ok", (name, t)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_kept_quantized_equals_transformers_quantized(run, world):
    """keep_quantized=True: transformers' quantized layout (fp8 weights, F32 or E8M0 block scales, experts
    fused with their scales), loaded with the checkpoint's bytes unchanged. Each rank's shard of every
    parameter equals DTensor's piece of transformers' own quantized load (FSDP2 at W=1-3, where the
    weights' 256 and 384 rows and the scales' 2 and 3 rows do not divide; TP x FSDP at W=2), both
    sources. FSDP2 cuts a weight and its scale grid each by its own rows (not block-aligned): what FSDP2
    lays out, and the all-gather before use makes both whole again."""
    results = run("kept", world)
    for rank, r in enumerate(results):
        cases = dict(r["kept"])
        saved = cases.pop("saved")
        assert saved["bad"] == [] and saved["keys_differ"] == [] and saved["checked"] > 20, (rank, saved)
        kind, text = saved["refused"]
        assert kind == "InvalidArgument" and "save(dtype=torch.bfloat16)" in text and "scales" in text, saved["refused"]
        assert len(cases) == 3 * 2 * (2 if world % 2 == 0 else 1), sorted(cases)
        for case, t in cases.items():
            assert t["bad"] == [] and t["missing"] == [], (rank, case, t["bad"], t["missing"])
            assert t["dequantized"] == 0 and t["verify"] == "ok", (case, t)
            scale = "torch.float8_e8m0fnu" if "e8m0" in case or "u8" in case else "torch.float32"
            assert {"torch.float8_e4m3fn", scale, "torch.bfloat16"} <= set(t["dtypes"]), (case, t["dtypes"])
            if world > 1:
                fused_scales = [n for n in t["sharded"] if n.endswith("experts.gate_up_proj_scale_inv")]
                assert fused_scales, (case, "the fused experts' scales are sharded like any parameter")


def test_kept_quantized_refusals(run):
    """keep_quantized on an unquantized checkpoint, and fp8 parameters given a bf16 checkpoint (never cast
    into fp8 without scales): the same error on every rank, naming the checkpoint or the key and dtypes."""
    results = run("refusals", 2)
    assert results[0]["refusals"] == results[1]["refusals"]
    r = results[0]["refusals"]
    assert r["not_quantized"][0] == "InvalidArgument" and "no quantization_config" in r["not_quantized"][1], r
    kind, text = r["fp8_model_bf16_checkpoint"]
    assert kind == "ManifestMismatch" and "BF16" in text and "F8_E4M3" in text and "no conversion" in text, r
