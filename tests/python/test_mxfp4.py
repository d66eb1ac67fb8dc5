"""MXFP4 checkpoints (gpt-oss) into bf16 shards, against transformers (issue 18): the reader dequantizes
each expert from its packed blocks and E8M0 scales and writes the model's transpose; every rank's rows
are bit-identical to convert_moe_packed_tensors, and a FSDP2 / HSDP gpt-oss to transformers' own
Mxfp4Config(dequantize=True) load, logits included."""
import json
import os

import pytest

import ranks

import torch
import transformers  # noqa: F401 -- required: a missing package fails, never skips

from quant_workers import assert_one_error_everywhere, write_cases, write_two_files  # noqa: E402

MODULES_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def write_pairs(path):
    """Hand-made pairs over two files (the blocks in one, the scales in the other, with an index):
    every scale byte 0..255 (2^-127 .. 2^128: subnormal, F16 underflow and overflow, BF16 inf), experts
    that do not divide over 2..4 ranks, a pair with fewer experts than ranks, and a 2-D pair."""
    g = torch.Generator().manual_seed(0)
    shapes = {"a.experts": (5, 96, 2), "b.linear": (40, 1), "c.experts": (3, 33, 3)}  # (E..., out, in / 32)
    blocks, scales = {}, {}
    for key, (*lead, groups) in shapes.items():
        blocks[key + "_blocks"] = torch.randint(0, 256, (*lead, groups, 16), generator=g, dtype=torch.uint8)
        scales[key + "_scales"] = torch.randint(0, 256, (*lead, groups), generator=g, dtype=torch.uint8)
    scales["a.experts_scales"] = torch.arange(5 * 96 * 2, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(5, 96, 2)
    write_two_files(path, blocks, scales)


def write_gpt_oss(path, experts=5):
    """A tiny gpt-oss as the released checkpoints are: experts as MXFP4 pairs (random blocks, scales in
    gpt-oss's range), their biases, attention, router, embeddings and norms in bf16, and
    quantization_config {quant_method: mxfp4}. Five experts: no world size 2..4 divides them (six: for
    transformers' EP plan, which needs them to divide over its 2 ranks; FSDP2 over 4 leaves one empty)."""
    from safetensors.torch import load_file, save_file
    cfg = transformers.GptOssConfig(hidden_size=64, intermediate_size=96, num_local_experts=experts, num_experts_per_tok=2,
                                    head_dim=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    vocab_size=37, max_position_embeddings=512, sliding_window=16,
                                    tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    state = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    out = {}
    for key, value in state.items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, n_in, n_out = value.shape  # the model's [E, in, out]
            out[key + "_blocks"] = torch.randint(0, 256, (experts, n_out, n_in // 32, 16), generator=g,
                                                 dtype=torch.uint8)
            out[key + "_scales"] = torch.randint(116, 130, (experts, n_out, n_in // 32), generator=g,
                                                 dtype=torch.uint8)
        else:
            out[key] = value
    os.remove(path / "model.safetensors")
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": MODULES_NOT_CONVERTED}
    (path / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mxfp4")
    write_pairs(root / "pairs")
    write_gpt_oss(root / "gpt_oss_mxfp4")
    write_gpt_oss(root / "gpt_oss_mxfp4_6", experts=6)
    return root


@pytest.fixture(scope="module")
def bad_checkpoints(checkpoints, tmp_path_factory):
    """ROOT/malformed/<case>: MXFP4 pairs wrong in each way; ROOT/kept_mismatch: gpt-oss with one expert
    tensor's blocks of another shape."""
    import shutil
    from safetensors.torch import load_file, save_file
    root = tmp_path_factory.mktemp("mxfp4-bad")
    write_malformed(root / "malformed")
    shutil.copytree(checkpoints / "gpt_oss_mxfp4", root / "kept_mismatch")
    tensors = load_file(str(root / "kept_mismatch" / "model.safetensors"))
    tensors[MISMATCHED] = tensors[MISMATCHED][:, :, :2].contiguous()
    save_file(tensors, str(root / "kept_mismatch" / "model.safetensors"), metadata={"format": "pt"})
    return root


MISMATCHED = "model.layers.1.mlp.experts.down_proj_blocks"


@pytest.fixture(scope="module")
def run(checkpoints, bad_checkpoints, tmp_path_factory):
    """run(scenario, world): its per-rank results, from one launch per world size (rank start-up dominates);
    the malformed checkpoints last."""
    bad = [("malformed", bad_checkpoints)]
    return ranks.Scenarios("mxfp4_worker.py", tmp_path_factory, {
        1: ["all", "kept"], 2: ["all", "kept"] + bad + [("kept_mismatch", bad_checkpoints)], 3: ["all", "kept"] + bad,
        4: ["all", "kept"]}, root=checkpoints)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_rank_equals_transformers(run, world):
    results = run("all", world)
    for rank, r in enumerate(results):
        # Hand-made pairs, every target, both sources: each rank's rows equal convert_moe_packed_tensors.
        assert len(r["mapping"]) == 8
        for case, m in r["mapping"].items():
            assert m["bad"] == [], (rank, case, m)
            if case.endswith("/packed"):  # blocks and scales kept as stored, into uint8 tensors
                assert m["checked"] == 6 and m["dequantized"] == 0 and m["dtypes"] == ["torch.uint8"], (case, m)
                continue
            assert m["checked"] == 3 and m["dequantized"] == 3, (case, m)
        # A FSDP2 (and at even W an HSDP) gpt-oss: every parameter, and the logits, equal transformers'.
        t = r["transformers"]
        assert len(t["experts"]) == 2
        runs = [k for k in t if "/" in k]
        assert len(runs) == (4 if world % 2 == 0 else 2), runs
        for case in runs:
            c = t[case]
            assert c["bad"] == [], (rank, case, c["bad"])
            assert c["dequantized"] == 4 and c["verify"] == "ok" and c["skipped"] == 0, (case, c)
            assert c["logits"] in (True, None), (rank, case)
        f = t["from_pretrained"]
        assert f["bad"] == [] and f["dequantized"] == 4, f
        assert f["saved_quantization_config"] is None and f["model_quantization_config"] is False, f


def write_malformed(root):
    """One checkpoint per way an MXFP4 pair can be wrong (a model shape that is not the blocks'
    transpose is the C++ test's: the explicit mapping takes its shape from the checkpoint)."""
    blocks = torch.zeros(5, 40, 2, 16, dtype=torch.uint8)
    scales = torch.full((5, 40, 2), 127, dtype=torch.uint8)
    write_cases(root, {
        "no_scales": {"x.experts_blocks": blocks},
        "scales_disagree": {"x.experts_blocks": blocks, "x.experts_scales": scales[:, :, :1].contiguous()},
        "not_16_a_group": {"x.experts_blocks": torch.zeros(5, 40, 4, 8, dtype=torch.uint8),
                           "x.experts_scales": torch.zeros(5, 40, 4, dtype=torch.uint8)},
        "unknown_method": {"x.experts_blocks": blocks, "x.experts_scales": scales},
    })
    (root / "unknown_method" / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq"}}))


@pytest.mark.parametrize("world", [2, 3])
def test_malformed_pairs_are_one_checkpoint_error_on_every_rank(run, world):
    results = run("malformed", world)
    assert_one_error_everywhere(results, {
        "no_scales": ["x.experts_blocks' [5, 40, 2, 16]", "has no 'x.experts_scales'"],
        "scales_disagree": ["x.experts", "[5, 40, 2, 16]", "[5, 40, 1]", "[5, 64, 40]"],
        "not_16_a_group": ["x.experts", "[5, 40, 4, 8]", "[5, 40, 4]"],
        "unknown_method": ["config.json", "\"gptq\""]})


def test_inspect_names_each_entrys_quantization(checkpoints, shardcast_bin, tmp_path):
    import subprocess
    out = subprocess.run([str(shardcast_bin), "inspect", "--json", str(checkpoints / "gpt_oss_mxfp4")],
                         check=True, capture_output=True, text=True, timeout=120).stdout
    quant = {t["key"]: (t["quant"], t["quant_partner"]) for t in json.loads(out)["tensors"]}
    key = "model.layers.0.mlp.experts.gate_up_proj"
    assert quant[key + "_blocks"] == ("mxfp4", key + "_scales")
    assert quant[key + "_scales"] == ("mxfp4 scales", key + "_blocks")
    assert quant[key + "_bias"] == ("", "") and quant["lm_head.weight"] == ("", "")
    table = subprocess.run([str(shardcast_bin), "inspect", str(checkpoints / "gpt_oss_mxfp4")], check=True,
                           capture_output=True, text=True, timeout=120).stdout
    assert "quant" in table.splitlines()[0] and "mxfp4 scales" in table


def test_convert_writes_the_models_transpose_equal_to_transformers(checkpoints, shardcast_bin, tmp_path):
    """`shardcast convert` of gpt-oss's MXFP4: every pair becomes the model's "<key>" [E, in, out] in bf16,
    equal to convert_moe_packed_tensors bit for bit; the scales are gone, everything else is copied. A
    large pair (83 MB of bf16, over one 64 MiB output chunk) has a chunk end inside a row of an expert."""
    import subprocess
    from safetensors.torch import load_file, save_file
    from mxfp4_worker import reference

    big = tmp_path / "big"
    big.mkdir()
    g = torch.Generator().manual_seed(3)
    pair = {"e.experts_blocks": torch.randint(0, 256, (5, 2900, 90, 16), generator=g, dtype=torch.uint8),
            "e.experts_scales": torch.randint(110, 135, (5, 2900, 90), generator=g, dtype=torch.uint8),
            "e.bias": torch.randn(5, 2900, generator=g).to(torch.bfloat16)}
    save_file(pair, str(big / "model.safetensors"))
    (big / "config.json").write_text(json.dumps({"model_type": "gpt_oss", "quantization_config":
                                                 {"quant_method": "mxfp4"}}))
    for name, src in (("gpt_oss", checkpoints / "gpt_oss_mxfp4"), ("big", big)):
        dst = tmp_path / f"{name}-bf16"
        r = subprocess.run([str(shardcast_bin), "convert", str(src), str(dst)], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr
        assert "quantization_config" not in json.loads((dst / "config.json").read_text())
        given, got = {}, {}
        for f in sorted(src.glob("*.safetensors")):
            given.update(load_file(str(f)))
        for f in sorted(dst.glob("*.safetensors")):
            got.update(load_file(str(f)))
        params = sorted(k[: -len("_blocks")] for k in given if k.endswith("_blocks"))
        assert params and sorted(got) == sorted(params + [k for k in given if not k.endswith(("_blocks", "_scales"))])
        for key in params:
            want = reference(given[key + "_blocks"], given[key + "_scales"], torch.bfloat16)
            assert got[key].dtype == torch.bfloat16 and got[key].shape == want.shape, (key, got[key].shape, want.shape)
            assert torch.equal(got[key].view(torch.int16), want.view(torch.int16)), key
        for key in got:
            if key not in params:
                assert torch.equal(got[key].view(torch.uint8), given[key].view(torch.uint8)), key


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_kept_quantized_equals_transformers_quantized_layout(run, world):
    """from_pretrained(keep_quantized=True) of gpt-oss's MXFP4: transformers' quantized layout
    (Mxfp4GptOssExperts: the packed blocks as uint8 [E, out, in / 2]) with each expert's E8M0 scales as
    a uint8 parameter beside its blocks, so FSDP2 (5 experts over 2-4 ranks: uneven, an empty rank at
    W=4), HSDP and transformers' EP plan cut both over the same experts. Each rank's shard equals
    DTensor's piece of the bytes transformers' quantized load swizzles; gathered and dequantized by
    transformers, the experts equal its Mxfp4Config(dequantize=True) load; save writes the checkpoint's
    `*_blocks` / `*_scales` back byte for byte."""
    results = run("kept", world)
    for rank, r in enumerate(results):
        cases = r["kept"]
        assert len(cases) == (6 if world % 2 == 0 else 2), sorted(cases)
        for case, t in cases.items():
            assert t["bad"] == [] and t["missing"] == [] and t["extra"] == [], (rank, case, t)
            assert t["experts_dequantized"] == 4 and t["experts_dequantized_wrong"] == [], (rank, case, t)
            assert t["unpaired"] == [], (rank, case, "scales cut otherwise than their blocks", t["unpaired"])
            assert t["dequantized"] == 0 and t["verify"] == "ok" and t["skipped"] == 0, (case, t)
            assert {"torch.uint8", "torch.float32", "torch.bfloat16"} == set(t["dtypes"]), (case, t["dtypes"])
            if world > 1 or case.startswith("ep"):
                scales = [n for n in t["sharded"] if n.endswith("experts.gate_up_proj_scales")]
                assert len(scales) == 2, (case, "the scales are cut like their blocks", t["sharded"])
            if case.endswith("each-rank"):
                assert t["saved_keys_differ"] == [] and t["saved_bad"] == [], (rank, case, t)


def test_kept_quantized_blocks_of_another_shape_are_one_error_on_every_rank(run):
    """A checkpoint whose blocks for one expert tensor do not merge into the kept model's [E, out, in / 2]
    (bad_checkpoints' kept_mismatch): the same ManifestMismatch on every rank, naming the key, the blocks'
    shape, what they merge to, the file and the model's shape."""
    key = MISMATCHED
    results = run("kept_mismatch", 2)
    seen = [r["kept_mismatch"] for r in results]
    assert seen[0] == seen[1] and seen[0]["type"] == "ManifestMismatch", seen
    for word in ("key 'model.layers.1.mlp.experts.down_proj'", key + "' [5, 64, 2, 16]", "kept quantized is [5, 64, 32]",
                 "kept_mismatch/model.safetensors", "[5, 64, 48]"):
        assert word in seen[0]["message"], (word, seen[0]["message"])
