"""Ranks of test_conventions.py: `python conventions_worker.py MODE ROOT OUT` with torchrun's variables.

MODE "all", in one launch per world size:
  wrapped   the same small model loaded plain and wrapped as training scripts wrap it (checkpoint_wrapper
            on its blocks, fully_shard, then torch.compile: names carry `_checkpoint_wrapped_module.`
            and `_orig_mod.`): both receive the same bytes, and both save the same keys and bytes.
  teardown  last: a load, then destroy_process_group at once, with the model still alive (no `del model;
            gc.collect(); dist.barrier()`); the result is written after it, and the test checks that
            every process then exited promptly.

MODE "pretrained" (a world of one): from_pretrained(model_cls=...) with an Auto class, a model class and a
callable(config), each receiving the checkpoint's bytes; and a model_cls that is none of these.
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import shardcast

ROWS, COLS = 7, 5  # 7 rows: uneven over 2 and 3 ranks


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(COLS, ROWS)
        self.register_buffer("scale", torch.zeros(3))  # persistent: loaded by broadcast


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(ROWS, 3)


def build(world, wrapped):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = Net()
    if wrapped:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return torch.compile(model) if wrapped else model


def _locals(model):
    from shardcast._names import fqn
    out = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        local = t.to_local() if hasattr(t, "to_local") else t
        out[fqn(name)] = local.detach().clone()
    return out


def wrapped(root, rank, world):
    from safetensors.torch import load_file
    ckpt = os.path.join(root, "ckpt")
    plain, wrap = build(world, False), build(world, True)
    names = [n for n, _ in wrap.named_parameters()]
    shardcast.load(plain, ckpt, timeout=60)
    shardcast.load(wrap, ckpt, timeout=60)
    a, b = _locals(plain), _locals(wrap)
    bad = [k for k in a if k not in b or a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    saved = os.path.join(os.path.dirname(sys.argv[3]), f"saved-{world}")
    shardcast.save(plain, os.path.join(saved, "plain"), overwrite=True, timeout=60)
    shardcast.save(wrap, os.path.join(saved, "wrapped"), overwrite=True, timeout=60)
    out = {"names": names, "keys_equal": sorted(a) == sorted(b), "bad": bad}
    if rank == 0:
        ref = load_file(os.path.join(ckpt, "model.safetensors"))
        p = load_file(os.path.join(saved, "plain", "model.safetensors"))
        w = load_file(os.path.join(saved, "wrapped", "model.safetensors"))
        out["saved_keys"] = [sorted(p), sorted(w), sorted(ref)]
        out["saved_bad"] = [k for k in ref if not (torch.equal(ref[k], p.get(k, torch.empty(0)))
                                                   and torch.equal(ref[k], w.get(k, torch.empty(0))))]
    return out


def teardown(root, rank, world):
    model = build(world, False)
    shardcast.load(model, os.path.join(root, "ckpt"), source="rank0", timeout=60)  # bytes over the load's group
    t0 = time.monotonic()
    dist.destroy_process_group()  # at once: the model, its DTensors and the load's groups still alive
    return {"destroy_seconds": time.monotonic() - t0}


def pretrained(root):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, LlamaForCausalLM
    ckpt = os.path.join(root, "llama")
    ref = {}
    for f in sorted(os.listdir(ckpt)):
        if f.endswith(".safetensors"):
            ref.update(load_file(os.path.join(ckpt, f)))
    out = {}
    for name, cls in (("default", None), ("auto", AutoModelForCausalLM), ("class", LlamaForCausalLM),
                      ("callable", lambda config: LlamaForCausalLM(config))):
        model = shardcast.from_pretrained(ckpt, model_cls=cls, dtype=torch.float32, prefetch=False)
        got = {n: p.to_local() for n, p in model.named_parameters()}
        out[name] = {"type": type(model).__name__, "bad": [n for n, t in got.items() if n in ref and
                                                            not torch.equal(t, ref[n])],
                     "loaded": sum(n in ref for n in got)}
    try:
        shardcast.from_pretrained(ckpt, model_cls=42, prefetch=False)
        out["bad_cls"] = None
    except shardcast.ShardcastError as e:
        out["bad_cls"] = [type(e).__name__, str(e)]
    return out


def main():
    mode, root, out = sys.argv[1:4]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if mode == "pretrained":
        result = pretrained(root)
    else:
        dist.init_process_group("gloo")
        result = {"wrapped": wrapped(root, rank, world), "teardown": teardown(root, rank, world)}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    # No cleanup here on purpose: the process must exit by itself, promptly.


if __name__ == "__main__":
    main()
