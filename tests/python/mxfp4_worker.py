"""One rank of the MXFP4 tests: `python mxfp4_worker.py MODE ROOT OUT` under torchrun's variables.

mapping:      the explicit {key: (local, begin, end)} path over hand-made MXFP4 pairs (every scale byte
              0..255, experts that do not divide over the ranks, a 2-D pair), to BF16, F16 and F32, both
              sources: each rank's rows equal transformers' convert_moe_packed_tensors, bit for bit.
transformers: a tiny gpt-oss whose experts are MXFP4 (random blocks and scales), built in bf16 from the
              checkpoint's config without quantization_config, fully_shard on a CPU mesh (FSDP, and
              HSDP 2 x W/2 at even W), shardcast.load: every parameter equals transformers'
              Mxfp4Config(dequantize=True) load, and so do the logits; shardcast.from_pretrained too.
kept:         from_pretrained(keep_quantized=True): transformers' quantized gpt-oss layout (Mxfp4GptOssExperts,
              the packed blocks as uint8 [E, out, in / 2], their E8M0 scales beside them) on FSDP2, HSDP
              and EP x FSDP (transformers' EP plan) meshes, both sources: each rank's local shard of
              every parameter is DTensor's piece of what transformers' quantized load hands its GPU
              swizzle; all-gathered and dequantized with transformers' convert_moe_packed_tensors, the
              experts equal its Mxfp4Config(dequantize=True) load; shardcast.save writes the checkpoint's
              blocks and scales back byte for byte.
malformed:    checkpoints whose pair cannot be read (no scales, scales that disagree with the blocks,
              blocks that are not the model's transpose, a quant_method shardcast does not read): the
              exception on this rank.
"""
import os

import torch

import shardcast
from quant_workers import malformed_errors, packed, rows, run, shards_against

TARGETS = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                      b.contiguous().view(torch.uint8))


def reference(blocks, scales, dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    if blocks.dim() == 3:  # a 2-D pair: one expert
        return convert_moe_packed_tensors(blocks[None], scales[None], dtype=dtype)[0]
    return convert_moe_packed_tensors(blocks, scales, dtype=dtype)


def mapping(root, rank, world):
    from safetensors.torch import load_file
    path = os.path.join(root, "pairs")
    full = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            full.update(load_file(os.path.join(path, f)))
    names = sorted(k[: -len("_blocks")] for k in full if k.endswith("_blocks"))
    out = {}
    for source in ("rank0", "each-rank"):
        for tname, dtype in TARGETS.items():
            m, want = {}, {}
            for key in names:
                ref = reference(full[key + "_blocks"], full[key + "_scales"], dtype)
                b, e = rows(ref.shape[0], world, rank)
                m[key] = (torch.empty((e - b,) + tuple(ref.shape[1:]), dtype=dtype), b, e)
                want[key] = ref[b:e]
            report = shardcast.load(m, path, source=source, verify=True, chunk_bytes=4096)
            out[f"{source}/{tname}"] = {"bad": [k for k, (t, _, _) in m.items() if not same_bits(t, want[k])],
                                        "checked": len(m), "dequantized": report["dequantized"]}
    out.update(packed(full, path, rank, world))
    return out


def build(ckpt, mesh):
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(ckpt)
    del config.quantization_config  # a bf16 model of the MXFP4 checkpoint
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    shardcast.prepare(model, config=config)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def compare(model, want):
    bad = []
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        if not same_bits(full.detach(), want[name].detach()):
            bad.append(name)
    return bad


def logits_equal(model, ref):
    ids = torch.tensor([[1, 5, 9, 2, 30, 7, 3, 11]])
    with torch.no_grad():
        got = model(input_ids=ids).logits
        exp = ref(input_ids=ids).logits
    return same_bits(got, exp)


def transformers_flow(root, rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM, Mxfp4Config
    ckpt = os.path.join(root, "gpt_oss_mxfp4")
    ref = AutoModelForCausalLM.from_pretrained(ckpt, quantization_config=Mxfp4Config(dequantize=True),
                                               dtype=torch.bfloat16)
    want = dict(ref.named_parameters())
    meshes = {"fsdp": init_device_mesh("cpu", (world,))}
    if world % 2 == 0:
        meshes["hsdp"] = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    out = {"experts": [n for n, _ in ref.named_parameters() if n.endswith("experts.gate_up_proj")]}
    for mesh_name, mesh in meshes.items():
        for source in ("rank0", "each-rank"):
            model = build(ckpt, mesh)
            report = shardcast.load(model, ckpt, source=source, verify=True)
            out[f"{mesh_name}/{source}"] = {"bad": compare(model, want), "dequantized": report["dequantized"],
                                            "verify": report["ranks"][rank]["verify"],
                                            "skipped": report["skipped_keys"],
                                            "logits": logits_equal(model, ref) if mesh_name == "fsdp" else None}
    one = shardcast.from_pretrained(ckpt, dtype=torch.bfloat16)
    out["from_pretrained"] = {"bad": compare(one, want), "dequantized": one.shardcast_report["dequantized"]}
    # Dequantized: the model's config no longer says MXFP4 (transformers drops it too), and saved with
    # the checkpoint's own config.json, neither does the bf16 checkpoint's.
    import json
    saved = os.path.join(root, f"saved-dequantized-{world}")
    shardcast.save(one, saved, overwrite=True, config=os.path.join(ckpt, "config.json"))
    with open(os.path.join(saved, "config.json")) as f:
        out["from_pretrained"]["saved_quantization_config"] = json.load(f).get("quantization_config")
    out["from_pretrained"]["model_quantization_config"] = hasattr(one.config, "quantization_config")
    return out


def quantized_reference(ckpt):
    """What transformers' quantized load of the MXFP4 checkpoint holds before its GPU swizzle, by name
    of the kept-quantized model: the checkpoint's tensors, each "<proj>_blocks" as the uint8
    [E, out, in / 2] that `swizzle_mxfp4_convertops` reshapes it to, the experts' biases in the float32
    Mxfp4GptOssExperts declares, everything else as stored. (transformers' own quantized load cannot run
    here: it fetches its triton kernels from the Hub and swizzles on a GPU. Its save unswizzles back to
    these same bytes: `Mxfp4ReverseDeserialize`.)"""
    from safetensors.torch import load_file
    full = load_file(os.path.join(ckpt, "model.safetensors"))
    want = {}
    for k, v in full.items():
        if k.endswith("_blocks"):
            want[k[: -len("_blocks")]] = v.reshape(*v.shape[:-2], -1)
        elif k.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):
            want[k] = v.to(torch.float32)
        else:
            want[k] = v
    return full, want


def kept(root, rank, world):
    from transformers import AutoModelForCausalLM, Mxfp4Config
    layouts = [("fsdp", "gpt_oss_mxfp4", {})]
    if world % 2 == 0:  # transformers' EP plan needs the experts to divide over its ranks: six of them
        layouts += [("hsdp", "gpt_oss_mxfp4", {"dp_replicate_size": 2, "fsdp_size": world // 2}),
                    ("ep", "gpt_oss_mxfp4_6", {"ep_size": 2, "fsdp_size": world})]
    references = {}
    for name in {c for _, c, _ in layouts}:
        ckpt = os.path.join(root, name)
        ref = AutoModelForCausalLM.from_pretrained(ckpt, quantization_config=Mxfp4Config(dequantize=True),
                                                   dtype=torch.bfloat16)
        references[name] = quantized_reference(ckpt) + (
            {n: p.detach() for n, p in ref.named_parameters() if n.endswith(("gate_up_proj", "down_proj"))},)
        del ref
    out = {}
    for (layout, name, sizes), source in [(lo, s) for lo in layouts for s in ("rank0", "each-rank")]:
        ckpt = os.path.join(root, name)
        full, want, dequantized = references[name]
        model = shardcast.from_pretrained(ckpt, keep_quantized=True, source=source, verify=True, **sizes)
        report, got = model.shardcast_report, dict(model.named_parameters())
        bad, dtypes, sharded = shards_against(model, want)
        # Each expert's scales are cut exactly as its blocks: the same mesh, placements and local experts.
        unpaired = []
        for n in dequantized:
            b, sc = got[n], got[n + "_scales"]
            lb = b.to_local() if hasattr(b, "to_local") else b
            ls = sc.to_local() if hasattr(sc, "to_local") else sc
            if (getattr(b, "placements", None) != getattr(sc, "placements", None)
                    or getattr(b, "device_mesh", None) != getattr(sc, "device_mesh", None) or lb.shape[0] != ls.shape[0]):
                unpaired.append(n)
        # The kept experts, gathered whole and dequantized by transformers: its dequantized load's values.
        wrong = []
        for n, d in dequantized.items():
            blocks, scales = got[n], got[n + "_scales"]
            blocks = blocks.full_tensor() if hasattr(blocks, "full_tensor") else blocks
            scales = scales.full_tensor() if hasattr(scales, "full_tensor") else scales
            blocks = blocks.detach().reshape(*scales.shape, 16)
            if not same_bits(reference(blocks, scales.detach(), torch.bfloat16), d):
                wrong.append(n)
        case = {"bad": bad, "missing": sorted(set(want) - set(got)), "extra": sorted(set(got) - set(want)),
                "dtypes": dtypes, "sharded": sharded, "dequantized": report["dequantized"],
                "verify": report["ranks"][rank]["verify"], "skipped": report["skipped_keys"],
                "experts_dequantized_wrong": wrong, "unpaired": unpaired, "experts_dequantized": len(dequantized)}
        if source == "each-rank":  # saved back: the checkpoint's own tensors, byte for byte
            from safetensors.torch import load_file
            saved = os.path.join(root, f"saved-{layout}-{world}")
            shardcast.save(model, saved, overwrite=True)
            written = load_file(os.path.join(saved, "model.safetensors"))
            case["saved_keys_differ"] = sorted(set(written) ^ set(full))
            # (the experts' biases are written in the float32 they were loaded into: exact)
            case["saved_bad"] = sorted(k for k in set(written) & set(full)
                                       if not same_bits(written[k], full[k].to(written[k].dtype)))
        out[f"{layout}/{source}"] = case
    return out


def kept_mismatch(root, rank, world):
    """keep_quantized=True where one expert's blocks hold fewer groups than the model's experts: the error
    on this rank."""
    try:
        shardcast.from_pretrained(os.path.join(root, "kept_mismatch"), keep_quantized=True, timeout=60)
        return {"type": None}
    except shardcast.ShardcastError as err:
        return {"type": type(err).__name__, "message": str(err)}


def malformed(root, rank, world):
    """Each malformed checkpoint under ROOT/malformed ("x.experts", its shape from the blocks): the error on this rank."""
    from shardcast._mapping import checkpoint_keys, entry_shape

    def mapping_for(path):
        shape = entry_shape(checkpoint_keys(path), "x.experts")
        b, e = rows(shape[0], world, rank)
        return {"x.experts": (torch.empty((e - b,) + tuple(shape[1:]), dtype=torch.bfloat16), b, e)}
    return malformed_errors(root, mapping_for)


def main():
    modes = {"transformers": transformers_flow, "mapping": mapping, "malformed": malformed, "kept": kept,
             "kept_mismatch": kept_mismatch}
    run(modes, lambda world: ["mapping", "transformers"])


if __name__ == "__main__":
    main()
