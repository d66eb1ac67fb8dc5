"""One rank of the MXFP4 tests: `python mxfp4_worker.py MODE ROOT OUT` under torchrun's variables.

mapping:      the explicit {key: (local, begin, end)} path over hand-made MXFP4 pairs (every scale byte
              0..255, experts that do not divide over the ranks, a 2-D pair), to BF16, F16 and F32, both
              sources: each rank's rows equal transformers' convert_moe_packed_tensors, bit for bit.
transformers: a tiny gpt-oss whose experts are MXFP4 (random blocks and scales), built in bf16 from the
              checkpoint's config without quantization_config, fully_shard on a CPU mesh (FSDP, and
              HSDP 2 x W/2 at even W), shardcast.load: every parameter equals transformers'
              Mxfp4Config(dequantize=True) load, and so do the logits; shardcast.from_pretrained too.
malformed:    checkpoints whose pair cannot be read (no scales, scales that disagree with the blocks,
              blocks that are not the model's transpose, a quant_method shardcast does not read): the
              exception on this rank.
"""
import os

import torch

import shardcast
from quant_workers import malformed_errors, packed, rows, run

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
    return out


def malformed(root, rank, world):
    """Each malformed checkpoint under ROOT/malformed ("x.experts", its shape from the blocks): the error on this rank."""
    from shardcast._mapping import checkpoint_keys, entry_shape

    def mapping_for(path):
        shape = entry_shape(checkpoint_keys(path), "x.experts")
        b, e = rows(shape[0], world, rank)
        return {"x.experts": (torch.empty((e - b,) + tuple(shape[1:]), dtype=torch.bfloat16), b, e)}
    return malformed_errors(root, mapping_for)


def main():
    modes = {"transformers": transformers_flow, "mapping": mapping, "malformed": malformed}
    run(modes, lambda world: ["mapping", "transformers"])


if __name__ == "__main__":
    main()
