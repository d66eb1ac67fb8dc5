"""One rank of test_from_pretrained: `python pretrained_worker.py MODE ROOT OUT` with torchrun's variables.

MODE compare: for every checkpoint under ROOT, shardcast.from_pretrained(...) against transformers'
              AutoModelForCausalLM.from_pretrained(...) + the same fully_shard calls on the same mesh:
              every parameter and buffer gathered to full tensors, and the logits of one batch, must be
              equal bit for bit.
MODE repo:    ROOT is a repo id; HF_HUB_CACHE points at a fake hub cache holding it; same comparison.
MODE launched: ROOT/llama through from_pretrained with no process group and no torchrun variables,
              only srun's (SLURM_PROCID, SLURM_NTASKS): the world is srun's, or an InvalidArgument.
MODE accelerate: shardcast._accelerate.prepare_pretrained against from_pretrained + accelerate's own
              FSDP2 preparation (fsdp2_prepare_model: auto-wrap, embedding and tail groups), same comparison.
MODE scenarios: several of compare, repo and accelerate in turn, in these processes (ranks.each_scenario).
"""
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

import ranks
import shardcast

DTYPE = torch.bfloat16


def bits(t):
    t = t.detach().contiguous()
    return t.view(torch.uint8) if t.numel() else t


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def reference(path, mesh, fsdp_kwargs):
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPE)
    units = shardcast._pretrained.shard_units(ref, ("layers",))
    for unit in units:
        shardcast._pretrained._fully_shard()(unit, mesh=mesh, **fsdp_kwargs)
    shardcast._pretrained._fully_shard()(ref, mesh=mesh, **fsdp_kwargs)
    return ref, len(units)


class CpuAccelerator:
    """What `Accelerator.prepare(model)` does under FSDP2 (set_auto_wrap_policy + fsdp2_prepare_model),
    on CPU: accelerate itself enables FSDP only on GPU distributed types."""

    def __init__(self, cpu_ram_efficient_loading):
        from types import SimpleNamespace
        from accelerate.utils import FullyShardedDataParallelPlugin
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, cpu_ram_efficient_loading=cpu_ram_efficient_loading)
        self.state = SimpleNamespace(fsdp_plugin=plugin)
        self.mixed_precision, self.device, self.torch_device_mesh, self.parallelism_config = "no", torch.device("cpu"), None, None
        self.is_main_process = dist.get_rank() == 0

    def prepare(self, model):
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model
        self.state.fsdp_plugin.set_auto_wrap_policy(model)
        return fsdp2_prepare_model(self, model)


def accelerate_pair(path):
    from shardcast._accelerate import prepare_pretrained
    from transformers import AutoModelForCausalLM
    model = prepare_pretrained(CpuAccelerator(cpu_ram_efficient_loading=True), path, dtype=DTYPE, verify=True)
    ref = CpuAccelerator(cpu_ram_efficient_loading=False).prepare(AutoModelForCausalLM.from_pretrained(path, dtype=DTYPE))
    units = sum(1 for m in ref.modules() if type(m).__name__.startswith("FSDP")) - 1
    return model, ref, units


def compare(name, path_or_id, ckpt_dir, mesh, fsdp_kwargs, accelerate=False):
    if accelerate:
        model, ref, units = accelerate_pair(ckpt_dir)
    else:
        model = shardcast.from_pretrained(path_or_id, mesh=mesh, dtype=DTYPE, fsdp_kwargs=fsdp_kwargs,
                                          verify=True)
        ref, units = reference(ckpt_dir, mesh, fsdp_kwargs)
    bad, checked = [], 0
    ours, theirs = dict(model.named_parameters()), dict(ref.named_parameters())
    if set(ours) != set(theirs):
        bad.append(f"parameter names differ: {sorted(set(ours) ^ set(theirs))}")
    for pname in sorted(set(ours) & set(theirs)):
        a, b = full(ours[pname]), full(theirs[pname])
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(bits(a), bits(b)):
            bad.append(pname)
        checked += 1
    ours_b, theirs_b = dict(model.named_buffers()), dict(ref.named_buffers())
    for bname in sorted(theirs_b):
        if bname not in ours_b or not torch.equal(bits(full(ours_b[bname])), bits(full(theirs_b[bname]))):
            bad.append(f"buffer {bname}")
        checked += 1
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=g)
    logits_equal, finite, note = None, None, ""
    try:
        with torch.no_grad():
            la, lb = model(input_ids=ids).logits, ref(input_ids=ids).logits
        logits_equal, finite = bool(torch.equal(bits(la), bits(lb))), bool(torch.isfinite(la.float()).all())
        if not logits_equal:
            bad.append(f"logits differ by up to {float((la.float() - lb.float()).abs().max())}")
    except AttributeError as e:  # torch 2.6: FSDP2's forward needs stream events a CPU device lacks
        if "record_event" not in str(e):
            raise
        note = f"FSDP2 forward on CPU is not supported by torch {torch.__version__}: {e}"
    report = model.shardcast_report
    return {"checked": checked, "bad": bad, "logits_equal": logits_equal, "finite": finite, "note": note,
            "units": units, "fsdp_module": type(model).__name__, "dtype": str(next(model.parameters()).dtype),
            "verify": report["ranks"][dist.get_rank()]["verify"]}


def launched(root, out_path):
    """No process group yet: from_pretrained makes it from the launcher's variables (srun's here)."""
    rank = os.environ.get("SLURM_PROCID", "?")
    try:
        model = shardcast.from_pretrained(os.path.join(root, "llama"), dtype=DTYPE, timeout=60)
    except shardcast.ShardcastError as e:
        result = {"error": type(e).__name__, "message": str(e)}
    else:
        p = model.model.embed_tokens.weight
        result = {"world": dist.get_world_size(), "rank": dist.get_rank(), "rows": p.to_local().shape[0],
                  "global_rows": p.shape[0], "report_world": model.shardcast_report["world_size"]}
        dist.destroy_process_group()
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(result, f)


def compare_all(root, mesh):
    result = {}
    for i, name in enumerate(sorted(os.listdir(root))):
        # One model also exercises fsdp_kwargs reaching every fully_shard.
        kwargs = {"reshard_after_forward": False} if i == 0 else {}
        result[name] = compare(name, os.path.join(root, name), os.path.join(root, name), mesh, kwargs)
    return result


def accelerate_all(root, mesh):
    return {name: compare(name, None, os.path.join(root, name), mesh, {}, accelerate=True)
            for name in sorted(os.listdir(root))}


def repo(repo_id, mesh):
    path = shardcast._pretrained.resolve_checkpoint(repo_id)
    result = {repo_id: compare(repo_id, repo_id, path, mesh, {})}
    result[repo_id]["resolved"] = path
    return result


def main():
    mode, root, out_path = sys.argv[1:4]
    if mode == "launched":
        return launched(root, out_path)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    modes = {"compare": compare_all, "accelerate": accelerate_all, "repo": repo}
    ranks.each_scenario(mode, root, lambda name, where: modes[name](where, mesh), f"{out_path}.{dist.get_rank()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
