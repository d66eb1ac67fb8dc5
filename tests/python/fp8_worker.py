"""One rank of the fp8 tests: `python fp8_worker.py MODE ROOT OUT` under torchrun's variables.

transformers: a bf16 DeepSeek-V3 built from the fp8 checkpoint's config without quantization_config,
              fully_shard on a CPU mesh, shardcast.load of the fp8 checkpoint: every parameter (fused
              experts included) equals transformers' own dequantized from_pretrained, bit for bit.
mapping:      the explicit {key: (local, begin, end)} path over odd shapes (576 and 200 rows, 7168 and
              96 columns, every scale dtype), in both sources: each rank's rows equal torch's
              (w.float() * scale_expanded).to(bf16) rows.
e8m0:         the transformers flow on the same DeepSeek-V3 with E8M0 scales ("scale_fmt": "ue8m0"),
              stored as F8_E8M0 tensors and as uint8 exponent bytes.
kept:         from_pretrained(keep_quantized=True) of those three, FSDP2 and TP x FSDP: every local shard
              equals DTensor's piece of transformers' own quantized parameter (fp8 weights, scales).
              The FSDP2 each-rank load of deepseek_fp8 is then saved back (byte for byte) and saved with
              dtype=bfloat16 (refused).
refusals:     keep_quantized on a bf16 checkpoint; a kept-quantized model given a bf16 checkpoint.
"""
import os

import torch
import torch.distributed as dist

import shardcast
from dtensor_ref import split_reference
from quant_workers import bf16_fsdp2, rows, run, shards_against


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


def transformers_quantized(ckpt):
    """transformers' own load of the fp8 checkpoint kept quantized (FP8Linear/FP8Experts holding the
    checkpoint's fp8 weights and block scales, experts fused), as it loads on a GPU; on this CPU its
    environment check would dequantize, so that check alone is lifted, for the reference only."""
    from transformers import AutoModelForCausalLM
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
    check = FineGrainedFP8HfQuantizer.validate_environment
    FineGrainedFP8HfQuantizer.validate_environment = lambda self, *args, **kwargs: None
    try:
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    finally:
        FineGrainedFP8HfQuantizer.validate_environment = check
    return {n: p.detach() for n, p in model.named_parameters()}


def kept(root, rank, world):
    """shardcast.from_pretrained(keep_quantized=True) of the fp8 checkpoints (F32, F8_E8M0 and uint8 E8M0
    scales), FSDP2 in both sources, and TP x FSDP by transformers' plans at even worlds: each rank's local
    shard of every parameter is DTensor's piece of transformers' own quantized parameter, bit for bit."""
    out = {}
    layouts = [("fsdp", {})] + ([("tp2", {"tp_size": 2})] if world % 2 == 0 else [])
    for name in ("deepseek_fp8", "deepseek_e8m0", "deepseek_u8"):
        ckpt = os.path.join(root, name)
        want = transformers_quantized(ckpt)
        for (layout, sizes), source in [(lo, s) for lo in layouts for s in ("rank0", "each-rank")]:
            model = shardcast.from_pretrained(ckpt, keep_quantized=True, source=source, verify=True, **sizes)
            report, got = model.shardcast_report, dict(model.named_parameters())
            bad, dtypes, sharded = shards_against(model, want)
            out[f"{name}/{layout}/{source}"] = {
                "bad": bad, "missing": sorted(set(want) - set(got)), "dtypes": dtypes,
                "dequantized": report["dequantized"], "verify": report["ranks"][rank]["verify"], "sharded": sharded}
            if (name, layout, source) == ("deepseek_fp8", "fsdp", "each-rank"):
                out["saved"] = saved_back(model, ckpt, os.path.join(root, f"saved-kept-{world}"))
    return out


def saved_back(model, ckpt, out_dir):
    """A kept-quantized model saved: the checkpoint's own tensors (fp8 weights, F32 block scales), byte for
    byte; and save(dtype=bfloat16), which would round those scales, refused on every rank."""
    import glob
    from safetensors import safe_open

    def tensors(d):
        out = {}
        for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
            with safe_open(f, "pt") as sf:
                out.update({k: sf.get_tensor(k) for k in sf.keys()})
        return out
    shardcast.save(model, out_dir, overwrite=True)
    dist.barrier()
    a, b = tensors(ckpt), tensors(out_dir)
    bad = sorted(k for k in set(a) & set(b) if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
                 or not torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)))
    try:
        shardcast.save(model, out_dir + "-bf16", dtype=torch.bfloat16, overwrite=True)
        refused = None
    except shardcast.ShardcastError as e:
        refused = [type(e).__name__, str(e)]
    return {"bad": bad, "keys_differ": sorted(set(a) ^ set(b)), "checked": len(set(a) & set(b)), "refused": refused}


def kept_cuda(root, rank, world):
    """On a GPU: transformers' own quantized from_pretrained (device_map="cuda", no check lifted) against
    shardcast.from_pretrained(keep_quantized=True, target="cuda"), every parameter bit for bit."""
    from transformers import AutoModelForCausalLM
    torch.cuda.set_device(rank % torch.cuda.device_count())
    ckpt = os.path.join(root, "deepseek_fp8")
    ref = AutoModelForCausalLM.from_pretrained(ckpt, device_map="cuda")
    want = {n: p.detach().cpu() for n, p in ref.named_parameters()}
    del ref
    model = shardcast.from_pretrained(ckpt, keep_quantized=True, target="cuda", verify=True)
    bad, devices, dtypes = [], set(), set()
    for n, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        devices.add(local.device.type)
        dtypes.add(str(local.dtype))
        ref = split_reference(want[n], tuple(p.device_mesh.shape), p.placements, p.device_mesh.get_coordinate())
        if local.dtype != ref.dtype or local.shape != ref.shape or not torch.equal(
                local.detach().cpu().contiguous().view(torch.uint8), ref.contiguous().view(torch.uint8)):
            bad.append(n)
    return {"bad": bad, "missing": sorted(set(want) - {n for n, _ in model.named_parameters()}),
            "devices": sorted(devices), "dtypes": sorted(dtypes), "verify": model.shardcast_report["ranks"][rank]["verify"]}


def refusals(root, rank, world):
    """keep_quantized on a checkpoint that is not fp8, and a kept-quantized model given a bf16 checkpoint:
    one error on every rank, naming what differed."""
    out = {}
    for label, call in (
            ("not_quantized", lambda: shardcast.from_pretrained(os.path.join(root, "bf16"), keep_quantized=True)),
            ("fp8_model_bf16_checkpoint", lambda: shardcast.load(_quantized_meta(root), os.path.join(root, "bf16")))):
        try:
            call()
            out[label] = None
        except shardcast.ShardcastError as e:
            out[label] = [type(e).__name__, str(e)]
    return out


def _quantized_meta(root):
    """The kept-quantized FSDP2 DeepSeek-V3 (fp8 weights), before loading."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.quantizers import AutoHfQuantizer
    config = AutoConfig.from_pretrained(os.path.join(root, "deepseek_fp8"))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    quantizer = AutoHfQuantizer.from_config(config.quantization_config, pre_quantized=True)
    quantizer.preprocess_model(model, dtype=torch.bfloat16)
    shardcast.prepare(model, config=config)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model, mesh=mesh)
    return model


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
                                                for name in ("deepseek_e8m0", "deepseek_u8")},
             "kept": kept, "kept_cuda": kept_cuda, "refusals": refusals}
    # all: the mapping check, and (at 2-3 ranks) the transformers one, in these same processes
    run(modes, lambda world: ["mapping"] + (["transformers"] if 2 <= world <= 3 else []), timeout_s=60,
        backend=lambda mode: "cpu:gloo,cuda:nccl" if mode.endswith("_cuda") else "gloo")


if __name__ == "__main__":
    main()
