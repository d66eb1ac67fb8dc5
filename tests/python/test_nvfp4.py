"""ModelOpt NVFP4 checkpoints into bf16 shards (issue 18): the reader dequantizes each rank's rows from
the packed E2M1 values, E4M3 block scales and F32 global scale; every rank's rows, and a FSDP2 Llama's
local shards, are bit-identical to a torch reference of the published format (transformers 5.23 has no
CPU dequantization of pre-quantized NVFP4); malformed triples are one CheckpointError on every rank;
`shardcast convert` writes what the bf16 twin holds."""
import json
import subprocess

import pytest

import ranks

import torch
import transformers  # noqa: F401 -- required: a missing package fails, never skips

from nvfp4_worker import reference  # noqa: E402
from quant_workers import assert_one_error_everywhere, write_cases, write_two_files  # noqa: E402

QUANT = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}


def triple(g, out, n_in, scales=None, global_scale=0.37):
    packed = torch.randint(0, 256, (out, n_in // 2), generator=g, dtype=torch.uint8)
    if scales is None:
        scales = torch.randint(0x01, 0x7F, (out, n_in // 16), generator=g, dtype=torch.uint8)
    return packed, scales.view(torch.float8_e4m3fn), torch.tensor(global_scale, dtype=torch.float32)


def write_triples(path):
    """Hand-made triples over two files (values in one, scales in the other, with an index): every E4M3
    scale byte 0..255 (zero, subnormals, 448, NaN, negatives), 37 rows (no world size 2..4 divides
    them), 3 rows (fewer than 4 ranks), an F16-overflowing global, and an input_scale (consumed)."""
    g = torch.Generator().manual_seed(0)
    every = torch.arange(37 * 16, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(37, 16)
    parts = {"a": triple(g, 37, 256, every, 1.7e-3), "b": triple(g, 3, 32), "c": triple(g, 50, 48, None, 2.5e4)}
    values, scales = {}, {}
    for m, (packed, scale, global_scale) in parts.items():
        values[m + ".weight"] = packed
        scales[m + ".weight_scale"] = scale
        scales[m + ".weight_scale_2"] = global_scale
    scales["a.input_scale"] = torch.tensor(0.02, dtype=torch.float32)
    write_two_files(path, values, scales)
    (path / "config.json").write_text(json.dumps({"quantization_config": QUANT}))


def write_llama(path):
    """A tiny Llama as ModelOpt exports it: every linear whose in is a multiple of 16 as an NVFP4
    triple plus input_scale (down_proj's in = 40 is not: it stays bf16, as do norms and embeddings)."""
    from safetensors.torch import load_file, save_file
    cfg = transformers.LlamaConfig(hidden_size=48, intermediate_size=40, num_hidden_layers=2, num_attention_heads=3,
                                   num_key_value_heads=1, head_dim=16, vocab_size=37, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(path)
    g = torch.Generator().manual_seed(1)
    out = {}
    for key, value in load_file(str(path / "model.safetensors")).items():
        if ".layers." in key and key.endswith("proj.weight") and value.shape[1] % 16 == 0:
            packed, scale, global_scale = triple(g, value.shape[0], value.shape[1])
            m = key[: -len(".weight")]
            out.update({key: packed, m + ".weight_scale": scale, m + ".weight_scale_2": global_scale,
                        m + ".input_scale": torch.tensor(0.5, dtype=torch.float32)})
        else:
            out[key] = value
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = dict(QUANT, ignore=["lm_head"])
    (path / "config.json").write_text(json.dumps(config))


def write_malformed(root):
    """One checkpoint per way an NVFP4 triple can be wrong, for "x.weight" [40, 64]."""
    packed, scale, global_scale = triple(torch.Generator().manual_seed(2), 40, 64)
    write_cases(root, {
        "no_weight_scale": {"x.weight": packed, "x.weight_scale_2": global_scale},
        "no_weight_scale_2": {"x.weight": packed, "x.weight_scale": scale},
        "scale_disagrees": {"x.weight": packed, "x.weight_scale": scale[:, :3].contiguous(),
                            "x.weight_scale_2": global_scale},
    })


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("nvfp4")
    write_triples(root / "triples")
    write_llama(root / "llama_nvfp4")
    write_malformed(root / "malformed")
    return root


def test_reference_on_hand_computed_blocks():
    # Row 0: scales 1.0 (0x38) and 2.0 (0x40); row 1: 0.5 (0x30) and 448 (0x7E); global 0.5.
    packed = torch.zeros(2, 16, dtype=torch.uint8)
    packed[0, 0], packed[0, 1], packed[0, 8], packed[1, 0], packed[1, 8] = 0x72, 0x9F, 0x11, 0x87, 0x0D
    scale = torch.tensor([[0x38, 0x40], [0x30, 0x7E]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    got = reference(packed, scale, torch.tensor(0.5), torch.float32)
    assert got[0, :4].tolist() == [0.5, 3.0, -3.0, -0.25]  # low nibble first: 2 (1.0), 7 (6.0); then -6, -0.5
    assert got[0, 16:18].tolist() == [0.5, 0.5] and got[1, 0].item() == 1.5
    assert got[1, 1].item() == 0.0 and torch.signbit(got[1, 1])  # code 8 is -0
    assert got[1, 16].item() == -672.0  # -3 x 448 x 0.5


# W=1, 2 and 4 (4 leaves "b"'s 3 rows one empty rank); W=3 and the other sources are load_test's Nvfp4Exact.
@pytest.mark.parametrize("world", [1, 3])  # 3: uneven rows (40 / 3) and a 40-row FSDP2 shard cut unevenly
def test_every_rank_equals_the_reference(checkpoints, tmp_path, world):
    results = ranks.run("nvfp4_worker.py", "all", checkpoints, world, tmp_path, timeout=600)
    for rank, r in enumerate(results):
        assert len(r["mapping"]) == 6
        for case, m in r["mapping"].items():
            assert m["bad"] == [], (rank, case, m)
            if case.endswith("/packed"):  # U8 weights and E4M3 scales kept as stored (scale_2 is 0-dim: left)
                assert m["dequantized"] == 0 and m["dtypes"] == ["torch.float8_e4m3fn", "torch.uint8"], (case, m)
                continue
            assert m["checked"] == 3 and m["dequantized"] == 3 and m["skipped"] == 0, (case, m)
        f = r["fsdp2"]
        assert f["bad"] == [] and f["dequantized"] == 12 and f["skipped"] == 0, (rank, f)
    assert_one_error_everywhere(results, {
        "no_weight_scale": ["'x.weight' U8 [40, 32]", "'x.weight_scale_2' F32 []", "no 'x.weight_scale'"],
        "no_weight_scale_2": ["'x.weight' U8 [40, 32]", "'x.weight_scale' F8_E4M3 [40, 4]", "no 'x.weight_scale_2'"],
        "scale_disagrees": ["x.weight", "U8 [40, 32]", "F8_E4M3 [40, 3]", "do not pair"]})


def test_convert_nvfp4_to_bf16_equals_the_twin(shardcast_bin, tmp_path):
    from safetensors.torch import load_file
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 64,
                               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                               "intermediate_size": 72, "vocab_size": 11, "torch_dtype": "bfloat16",
                               "quantization_config": QUANT}))
    nvfp4, twin, out = tmp_path / "nvfp4", tmp_path / "twin", tmp_path / "bf16"
    for args in (["--out", nvfp4], ["--out", twin, "--bf16-twin"]):
        r = subprocess.run([str(shardcast_bin), "synth", "--config", str(cfg), *map(str, args)], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr
    r = subprocess.run([str(shardcast_bin), "convert", str(nvfp4), str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    def tensors(d):
        got = {}
        for f in sorted(d.glob("*.safetensors")):
            got.update(load_file(str(f)))
        return got
    a, b, q = tensors(out), tensors(twin), tensors(nvfp4)
    assert sorted(a) == sorted(b) and not any(k.endswith(("_scale", "_scale_2", "input_scale")) for k in a)
    assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)
    key = "model.layers.0.mlp.up_proj.weight"  # the synthetic values, through the reference
    m = key[: -len(".weight")]
    assert q[key].dtype == torch.uint8 and a[key].shape == (72, 64)
    assert torch.equal(a[key].view(torch.int16),
                       reference(q[key], q[m + ".weight_scale"], q[m + ".weight_scale_2"], torch.bfloat16).view(torch.int16))


# Regression (issue 32): Python's shape rule took any "<m>.weight" beside a "<m>.weight_scale" for NVFP4
# and doubled its columns, where the C++ reader (loaders/quantization.cc) requires a U8 weight: an fp8
# weight with a float32 per-channel "weight_scale" (compressed-tensors) is not NVFP4. A U8 weight beside a
# scale of the wrong dtype still is (the reader then names what is wrong with the triple).
def test_python_shape_rule_is_the_readers_nvfp4_rule(tmp_path):
    from safetensors.torch import save_file
    from shardcast._mapping import checkpoint_keys, entry_shape
    g = torch.Generator().manual_seed(5)
    packed, scale, scale_2 = triple(g, 4, 32)
    save_file({"nv.weight": packed, "nv.weight_scale": scale, "nv.weight_scale_2": scale_2,
               "fp8.weight": torch.zeros(4, 16).to(torch.float8_e4m3fn), "fp8.weight_scale": torch.ones(4, 1),
               "u8.weight": torch.zeros(4, 16, dtype=torch.uint8), "u8.weight_scale": torch.ones(4, 1)},
              str(tmp_path / "model.safetensors"))
    keys = checkpoint_keys(tmp_path)
    assert entry_shape(keys, "nv.weight") == (4, 32)
    assert entry_shape(keys, "nv.weight", floating=False) == (4, 16)
    assert entry_shape(keys, "fp8.weight") == (4, 16)
    assert entry_shape(keys, "u8.weight") == (4, 32)
