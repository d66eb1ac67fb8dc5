"""One rank of the buffer and dtype tests: `python buffers_worker.py MODE ROOT OUT` under torchrun's variables
(MODE all: every scenario below, in order, in the same processes).

gemma:            prepare(buffer_init=...) given for buffers a built-in rule also covers (Gemma 3's
                  embed_scale and its sliding-attention inv_freq): the caller's values win; after
                  fully_shard + load every buffer must equal transformers' own, and so must the logits.
gemma_pretrained: the same through shardcast.from_pretrained(buffer_init=...).
gemma_builtin:    from_pretrained with no buffer_init: the built-in rules (embed_scale, and inv_freq per
                  layer type from rope_parameters[type], the global one linear x8) equal transformers'.
gemma_missing:    prepare without buffer_init, on a model with two non-persistent buffers no rule covers:
                  one ConfigError naming both.
gemma_noprepare:  load without prepare: the same ConfigError on every rank, through the handshake.
deepseek_fp32:    a bf16 model from_config on meta: prepare keeps e_score_correction_bias in fp32 (the
                  class's _keep_in_fp32_modules_strict), and the load equals from_pretrained(dtype=bf16).
alloc_fail:       rank 1 cannot give its shards storage (target cuda on a machine without one): every
                  rank raises the same error at once instead of waiting out the timeout.
"""
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import ranks
import shardcast


def meta_model(ckpt, dtype=None):
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(ckpt)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, **({"dtype": dtype} if dtype else {}))
    return config, model


def shard(model, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def full_state(model):
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.full_tensor() if hasattr(p, "full_tensor") else p
    return out


def gemma(root, rank, world):
    from transformers import AutoModelForCausalLM
    ckpt = os.path.join(root, "gemma3")
    ref = AutoModelForCausalLM.from_pretrained(ckpt)  # what transformers computes for every buffer
    ref_buffers = {n: b.detach().clone() for n, b in ref.named_buffers()}
    config, model = meta_model(ckpt)
    calls = []

    def from_reference(name, meta):
        calls.append(name)
        return ref_buffers[name]

    prep = shardcast.prepare(model, config=config, buffer_init={"*embed_scale": from_reference,
                                                               "*sliding_attention*inv_freq": from_reference})
    shard(model, world)
    report = shardcast.load(model, ckpt, verify=True)
    bad = [n for n, b in model.named_buffers() if not torch.equal(b, ref_buffers[n])]
    full = full_state(model)
    bad += [n for n, p in ref.named_parameters() if not torch.equal(full[n].detach(), p.detach())]
    ids = torch.tensor([[1, 5, 9, 2, 30, 7]])
    with torch.no_grad():
        logits, want = model(ids).logits, ref(ids).logits
    return {"bad": bad, "calls": sorted(set(calls)), "computed": prep["computed_buffers"],
            "logits_equal": bool(torch.equal(logits, want)),
            "logits_max_diff": float((logits - want).abs().max()), "verify": report["ranks"][rank]["verify"]}


def gemma_pretrained(root, rank, world):
    """The one-call API takes buffer_init too (it reaches prepare, before fully_shard)."""
    from transformers import AutoModelForCausalLM
    ckpt = os.path.join(root, "gemma3")
    ref = AutoModelForCausalLM.from_pretrained(ckpt)
    ref_buffers = {n: b.detach().clone() for n, b in ref.named_buffers()}
    model = shardcast.from_pretrained(ckpt, dtype=torch.float32, verify=True, buffer_init={
        "*sliding_attention*inv_freq": lambda name, meta: ref_buffers[name]})
    bad = [n for n, b in model.named_buffers() if not torch.equal(b, ref_buffers[n])]
    full = full_state(model)
    bad += [n for n, p in ref.named_parameters() if not torch.equal(full[n].detach(), p.detach())]
    return {"bad": bad, "verify": model.shardcast_report["ranks"][rank]["verify"]}


def catch(call):
    return ranks.shardcast_error(call)


def gemma_builtin(root, rank, world):
    from transformers import AutoModelForCausalLM
    ckpt = os.path.join(root, "gemma3")
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    model = shardcast.from_pretrained(ckpt, dtype=torch.float32)
    ref_buffers = dict(ref.named_buffers())
    bad = [n for n, b in model.named_buffers() if not torch.equal(b, ref_buffers[n])]
    ids = torch.tensor([[1, 5, 9, 2, 30, 7]])
    with torch.no_grad():
        logits, want = model(ids).logits, ref(ids).logits
    return {"bad": bad, "buffers": sorted(n for n, _ in model.named_buffers()),
            "logits_equal": bool(torch.equal(logits, want))}


def unruled(model):
    """Two non-persistent buffers no built-in rule covers, on the meta model."""
    model.model.register_buffer("alibi_slopes", torch.empty(4, device="meta"), persistent=False)
    model.lm_head.register_buffer("logit_bias_table", torch.empty(37, device="meta"), persistent=False)
    return model


def gemma_missing(root, rank, world):
    config, model = meta_model(os.path.join(root, "gemma3"))
    return catch(lambda: shardcast.prepare(unruled(model), config=config))


def gemma_noprepare(root, rank, world):
    ckpt = os.path.join(root, "gemma3")
    _, model = meta_model(ckpt)
    unruled(model)
    shard(model, world)
    return catch(lambda: shardcast.load(model, ckpt, timeout=30))


def deepseek_fp32(root, rank, world):
    from transformers import AutoModelForCausalLM
    ckpt = os.path.join(root, "deepseek_v3")
    config, model = meta_model(ckpt, dtype=torch.bfloat16)
    prep = shardcast.prepare(model, config=config)
    shard(model, world)
    shardcast.load(model, ckpt)
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    ref_buffers = dict(ref.named_buffers())
    out = {"kept_fp32": prep["kept_fp32"], "bad": []}
    for n, b in model.named_buffers():
        if "e_score_correction_bias" in n:
            out.setdefault("dtypes", []).append(str(b.dtype))
            if b.dtype != ref_buffers[n].dtype or not torch.equal(b, ref_buffers[n]):
                out["bad"].append(n)
    full = full_state(model)
    out["bad"] += [n for n, p in ref.named_parameters() if not torch.equal(full[n].detach(), p.detach())]
    return out


def alloc_fail(root, rank, world):
    ckpt = os.path.join(root, "gemma3")
    config, model = meta_model(ckpt)
    shardcast.prepare(model, config=config, buffer_init={"*": lambda n, m: torch.ones(m.shape, dtype=m.dtype)})
    shard(model, world)
    t0 = time.monotonic()
    result = catch(lambda: shardcast.load(model, ckpt, target="cuda" if rank == 1 else None, timeout=60))
    result["seconds"] = time.monotonic() - t0
    return result


def main():
    mode, root, out_path = sys.argv[1:4]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    modes = {"gemma": gemma, "gemma_pretrained": gemma_pretrained,
             "gemma_builtin": gemma_builtin, "gemma_missing": gemma_missing,
             "gemma_noprepare": gemma_noprepare,
             "deepseek_fp32": deepseek_fp32, "alloc_fail": alloc_fail}
    # "all": every scenario in these same processes (start-up dominates on a small machine). Each failure
    # scenario is agreed by every rank, so the process group stays in step; alloc_fail runs last.
    names = list(modes) if mode == "all" else [mode]
    if torch.cuda.is_available() and "alloc_fail" in names and mode == "all":
        names.remove("alloc_fail")
    result = {name: modes[name](root, rank, world) for name in names}
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
