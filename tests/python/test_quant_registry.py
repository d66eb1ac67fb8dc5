"""Python asks the C++ quantized-format registry (loaders/quant/format.h) and keeps no rule of its own
(issue 32): each checkpoint key's format, piece, partner, model key and shapes come through the binding,
agree with what `shardcast inspect` names, and are the same whether the dtypes are safetensors names (a
checkpoint's header) or torch dtypes (the tensors a save writes)."""
import json
import subprocess

import torch
from safetensors.torch import save_file

from shardcast._mapping import checkpoint_keys, entry_shape, quantized_keys


def write_every_format(path):
    """One checkpoint with each format complete and not, beside a plain tensor."""
    g = torch.Generator().manual_seed(3)
    u8 = lambda *s: torch.randint(0, 256, s, generator=g, dtype=torch.uint8)  # noqa: E731
    save_file({
        "plain.weight": torch.zeros(4, 8, dtype=torch.bfloat16),
        "fp8.weight": torch.zeros(160, 200).to(torch.float8_e4m3fn),
        "fp8.weight_scale_inv": torch.ones(2, 2),
        "orphan.weight": torch.zeros(4, 4).to(torch.float8_e5m2),
        "x.experts_blocks": u8(3, 10, 2, 16),
        "x.experts_scales": u8(3, 10, 2).view(torch.float8_e8m0fnu),
        "y.experts_blocks": u8(2, 4, 1, 16),
        "nv.weight": u8(6, 24),
        "nv.weight_scale": u8(6, 3).view(torch.float8_e4m3fn),
        "nv.weight_scale_2": torch.tensor(0.5),
        "nv.input_scale": torch.tensor(0.1),
        "half.weight": u8(2, 8),
        "half.weight_scale_2": torch.tensor(0.5),
    }, str(path / "model.safetensors"))
    return path


# key: (format, piece, partner, model key, complete)
EXPECTED = {
    "fp8.weight": ("fp8", "data", "fp8.weight_scale_inv", "fp8.weight", True),
    "fp8.weight_scale_inv": ("fp8", "scale", "fp8.weight", "fp8.weight", True),
    "orphan.weight": ("fp8", "data", "orphan.weight_scale_inv", "orphan.weight", False),
    "x.experts_blocks": ("mxfp4", "data", "x.experts_scales", "x.experts", True),
    "x.experts_scales": ("mxfp4", "scale", "x.experts_blocks", "x.experts", True),
    "y.experts_blocks": ("mxfp4", "data", "y.experts_scales", "y.experts", False),
    "nv.weight": ("nvfp4", "data", "nv.weight_scale", "nv.weight", True),
    "nv.weight_scale": ("nvfp4", "scale", "nv.weight", "nv.weight", True),
    "nv.weight_scale_2": ("nvfp4", "scale", "nv.weight", "nv.weight", True),
    "nv.input_scale": ("nvfp4", "sidecar", "nv.weight", "nv.weight", False),
    "half.weight": ("nvfp4", "data", "half.weight_scale", "half.weight", False),
    "half.weight_scale_2": ("nvfp4", "scale", "half.weight", "half.weight", True),
}


def test_each_key_is_the_registrys_verdict(tmp_path):
    keys = checkpoint_keys(write_every_format(tmp_path))
    assert set(keys.quant) == set(EXPECTED), sorted(keys.quant)
    for key, (fmt, piece, partner, model_key, complete) in EXPECTED.items():
        q = keys.quant[key]
        assert (q["format"], q["piece"], q["partner"], q["model_key"], q["complete"]) == \
               (fmt, piece, partner, model_key, complete), (key, q)
    assert keys.quant["x.experts_blocks"]["model_shape"] == [3, 64, 10]
    assert keys.quant["x.experts_blocks"]["kept_shape"] == [3, 10, 32]
    assert keys.quant["nv.weight"]["model_shape"] == [6, 48]
    assert keys.stored == {"x.experts": "x.experts_blocks", "y.experts": "y.experts_blocks"}
    # The shapes an explicit mapping loads: the registry's, for data only and floating entries only.
    assert entry_shape(keys, "x.experts") == (3, 64, 10)
    assert entry_shape(keys, "y.experts") == (2, 32, 4)  # no scales: the load names them missing
    assert entry_shape(keys, "nv.weight") == (6, 48) and entry_shape(keys, "nv.weight", floating=False) == (6, 24)
    assert entry_shape(keys, "nv.weight_scale") == (6, 3)
    assert entry_shape(keys, "fp8.weight") == (160, 200) and entry_shape(keys, "plain.weight") == (4, 8)
    assert entry_shape(keys, "absent") is None


def test_python_and_inspect_name_the_same_pairings(tmp_path, shardcast_bin):
    path = write_every_format(tmp_path)
    out = subprocess.run([str(shardcast_bin), "inspect", "--json", str(path)], check=True, capture_output=True,
                         text=True, timeout=120).stdout
    named = {t["key"]: (t["quant"], t["quant_partner"]) for t in json.loads(out)["tensors"]}
    keys = checkpoint_keys(path)
    for key in keys:
        q = keys.quant.get(key)
        if q is None or not q["complete"]:
            assert named[key] == ("", ""), (key, named[key])
            continue
        assert named[key][1] == q["partner"] and named[key][0].startswith(q["format"]), (key, named[key], q)


def test_torch_dtypes_give_the_same_verdicts(tmp_path):
    """What a save passes (torch dtypes, no checkpoint) is decided by the same rules as a checkpoint's header."""
    path = write_every_format(tmp_path)
    from safetensors import safe_open
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        tensors = [(k, f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()]
    torch_dtypes = {"BF16": torch.bfloat16, "F32": torch.float32, "U8": torch.uint8, "F8_E4M3": torch.float8_e4m3fn,
                    "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu}
    by_name = quantized_keys(tensors)
    by_torch = quantized_keys((k, torch_dtypes[d], s) for k, d, s in tensors)
    assert by_torch.quant == by_name.quant == checkpoint_keys(path).quant
    assert by_torch.stored == by_name.stored
