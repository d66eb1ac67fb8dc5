"""One rank of the fp8 tests: `python fp8_worker.py MODE ROOT OUT` under torchrun's variables.

transformers: a bf16 DeepSeek-V3 built from the fp8 checkpoint's config without quantization_config,
              fully_shard on a CPU mesh, shardcast.load of the fp8 checkpoint: every parameter (fused
              experts included) equals transformers' own dequantized from_pretrained, bit for bit.
mapping:      the explicit {key: (local, begin, end)} path over odd shapes (576 and 200 rows, 7168 and
              96 columns, every scale dtype), in both sources: each rank's rows equal torch's
              (w.float() * scale_expanded).to(bf16) rows.
e8m0:         the transformers flow on the same DeepSeek-V3 with E8M0 scales ("scale_fmt": "ue8m0"),
              stored as F8_E8M0 tensors and as uint8 exponent bytes.
"""
import os

import torch

import shardcast
from quant_workers import bf16_fsdp2, rows, run


def reference(w, s, block=(128, 128)):
    """torch's own formula: the fp32 product, one rounding to bf16."""
    r, c = w.shape
    expanded = s.float().repeat_interleave(block[0], 0)[:r].repeat_interleave(block[1], 1)[:, :c]
    return (w.float() * expanded).to(torch.bfloat16)


def transformers_flow(root, rank, world, name="deepseek_fp8"):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config
    ckpt = os.path.join(root, name)
    ref = AutoModelForCausalLM.from_pretrained(ckpt, quantization_config=FineGrainedFP8Config(dequantize=True),
                                               dtype=torch.bfloat16)
    model = bf16_fsdp2(ckpt, world)  # the one line: a bf16 model of the fp8 checkpoint
    report = shardcast.load(model, ckpt, verify=True)
    want = dict(ref.named_parameters())
    bad = []
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        if full.dtype != want[name].dtype or not torch.equal(full.detach().view(torch.uint8),
                                                                want[name].detach().view(torch.uint8)):
            bad.append(name)
    # The one call: from_pretrained of the fp8 checkpoint gives the same bf16 model.
    one = shardcast.from_pretrained(ckpt, dtype=torch.bfloat16)
    bad_one = []
    for name, p in one.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        if full.dtype != want[name].dtype or not torch.equal(full.detach().view(torch.uint8),
                                                                want[name].detach().view(torch.uint8)):
            bad_one.append(name)
    return {"bad": bad, "dequantized": report["dequantized"], "verify": report["ranks"][rank]["verify"],
            "fused": [n for n, _ in model.named_parameters() if "experts.gate_up_proj" in n],
            "from_pretrained_bad": bad_one, "from_pretrained_dequantized": one.shardcast_report["dequantized"],
            "from_pretrained_source": [one.shardcast_report["source"], one.shardcast_report["source_reason"]]}


def mapping(root, rank, world):
    from safetensors.torch import load_file
    path = os.path.join(root, "odd")
    full = load_file(os.path.join(path, "model.safetensors"))
    out = {}
    for source in ("rank0", "each-rank"):
        m, want = {}, {}
        for key in sorted(k for k in full if not k.endswith("_scale_inv")):
            w, s = full[key], full[key + "_scale_inv"]
            b, e = rows(w.shape[0], world, rank)
            m[key] = (torch.empty((e - b, w.shape[1]), dtype=torch.bfloat16), b, e)
            want[key] = reference(w, s)[b:e]
        report = shardcast.load(m, path, source=source, verify=True)
        out[source] = {"bad": [k for k, (t, b, e) in m.items() if not torch.equal(t.view(torch.uint8),
                                                                                    want[k].view(torch.uint8))],
                       "dequantized": report["dequantized"], "checked": len(m)}
    return out


def main():
    modes = {"transformers": transformers_flow, "mapping": mapping,
             # E8M0 scales ("scale_fmt": "ue8m0"): as F8_E8M0 tensors, and as uint8 exponent bytes
             "e8m0": lambda root, rank, world: {name: transformers_flow(root, rank, world, name)
                                                for name in ("deepseek_e8m0", "deepseek_u8")}}
    # all: the mapping check, and (at 2-3 ranks) the transformers one, in these same processes
    run(modes, lambda world: ["mapping"] + (["transformers"] if 2 <= world <= 3 else []), timeout_s=60)


if __name__ == "__main__":
    main()
