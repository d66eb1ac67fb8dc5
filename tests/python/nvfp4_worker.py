"""One rank of the NVFP4 tests: `python nvfp4_worker.py MODE ROOT OUT` under torchrun's variables.

mapping:   hand-made ModelOpt NVFP4 triples (every E4M3 scale byte, rows that do not divide over the
           ranks, fewer rows than ranks, weights and scales in two files), to BF16, F16 and F32 from
           rank 0 and to BF16 from each rank: each rank's rows equal reference() of the whole tensor, sliced by FSDP2's rule.
fsdp2:     a tiny Llama whose linears are NVFP4, built in bf16, fully_shard on a CPU mesh,
           shardcast.load: every DTensor's local shard equals reference() sliced as DTensor lays it out.
malformed: triples that cannot be read (no weight_scale, no weight_scale_2, a scale of another shape):
           the exception on this rank.
"""
import os

import torch

import shardcast
from quant_workers import bf16_fsdp2, malformed_errors, packed, rows, run

TARGETS = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}

# E2M1 by code, as the OCP MX format defines it (sign, 2 exponent bits with bias 1, 1 mantissa bit):
# code 8 is -0.0. ModelOpt's Python dequantize table writes +0 there; vLLM's reference, the hardware
# and shardcast give -0.0 (the two differ only in the sign of a zero).
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def reference(packed, scale, global_scale, dtype):
    """The published NVFP4 rule in torch, written independently of shardcast (transformers 5.23 has no
    CPU dequantization of pre-quantized NVFP4): the low nibble first, block scale times global scale in
    float32, the value times that in float32, one rounding to `dtype`."""
    out, half = packed.shape
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(out, 2 * half).long()
    block = scale.to(torch.float32) * global_scale.to(torch.float32).reshape(())
    return (E2M1[codes].view(out, -1, 16) * block.unsqueeze(-1)).reshape(out, 2 * half).to(dtype)


def same(a, b):
    """Bit for bit, except that any NaN equals any NaN (an E4M3 NaN scale's payload is the conversion's)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan = torch.isnan(a.float())
    if not torch.equal(nan, torch.isnan(b.float())):
        return False
    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.contiguous().view(bits)[~nan], b.contiguous().view(bits)[~nan])


def load_all(path):
    from safetensors.torch import load_file
    full = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            full.update(load_file(os.path.join(path, f)))
    return full


def dequantized(full, dtype):
    """{weight key: reference()} for every NVFP4 triple of a state dict."""
    return {k: reference(v, full[k + "_scale"], full[k + "_scale_2"], dtype)
            for k, v in full.items() if k.endswith(".weight") and k + "_scale" in full}


def mapping(root, rank, world):
    path = os.path.join(root, "triples")
    full = load_all(path)
    out = {}
    # every target from rank 0; each-rank reads its own rows: bf16 (the same kernel for every target)
    for source, tname in (("rank0", "bf16"), ("rank0", "f16"), ("rank0", "f32"), ("each-rank", "bf16")):
        dtype = TARGETS[tname]
        want = dequantized(full, dtype)
        m = {}
        for key, ref in want.items():
            b, e = rows(ref.shape[0], world, rank)
            m[key] = (torch.empty((e - b,) + tuple(ref.shape[1:]), dtype=dtype), b, e)
        report = shardcast.load(m, path, source=source, verify=True, chunk_bytes=4096)
        out[f"{source}/{tname}"] = {
            "bad": [k for k, (t, b, e) in m.items() if not same(t, want[k][b:e])],
            "checked": len(m), "dequantized": report["dequantized"], "skipped": report["skipped_keys"]}
    out.update(packed(full, path, rank, world))
    return out


def fsdp2(root, rank, world):
    ckpt = os.path.join(root, "llama_nvfp4")
    model = bf16_fsdp2(ckpt, world)  # a bf16 model of the NVFP4 checkpoint
    report = shardcast.load(model, ckpt, verify=True)
    full = load_all(ckpt)
    want = {**{k: v for k, v in full.items()}, **dequantized(full, torch.bfloat16)}
    bad, checked = [], 0
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        b, e = rows(want[name].shape[0], world, rank)  # FSDP2: Shard(0), torch.chunk's rows
        if not same(local.detach(), want[name][b:e]):
            bad.append(name)
        checked += 1
    return {"bad": bad, "checked": checked, "dequantized": report["dequantized"], "skipped": report["skipped_keys"]}


def malformed(root, rank, world):
    """Each malformed checkpoint under ROOT/malformed ("x.weight" [40, 64]): the error on this rank."""
    b, e = rows(40, world, rank)
    return malformed_errors(root, lambda path: {"x.weight": (torch.empty((e - b, 64), dtype=torch.bfloat16), b, e)})


def main():
    modes = {"mapping": mapping, "fsdp2": fsdp2, "malformed": malformed}
    run(modes, lambda world: list(modes))


if __name__ == "__main__":
    main()
