"""One rank of the layout tests: `python layout_worker.py MODE ROOT OUT` with torchrun's variables set.

MODE native:  for every model under ROOT and every layout in LAYOUTS (a JSON list of DistributedConfig
              keyword dicts), shardcast.from_pretrained(distributed_config=...) against transformers' own
              from_pretrained(distributed_config=...) on the same layout: every parameter's placements,
              mesh and local tensor, bit for bit; SOURCES (or SOURCE) picks shardcast's sources, each
              against the same reference. Where transformers' own
              loading fails on a layout, shardcast's local tensors are checked against the full tensors
              split by DTensor's own placement arithmetic (and the result says why: "native").
MODE manual:  a hand-built 2-d mesh (dp, tp): parallelize_module (Colwise/Rowwise) then fully_shard, loaded
              by shardcast.load and checked against transformers' full tensors split by DTensor's own
              placement arithmetic; then shardcast.save from that layout, re-read by from_pretrained.
"""
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

import ranks
import shardcast
from dtensor_ref import split_reference


def _bits(t):
    t = t.detach()
    return t.contiguous().view(torch.uint8) if t.numel() and t.element_size() else t.contiguous()


def _describe(p):
    from torch.distributed.tensor import DTensor
    if not isinstance(p, DTensor):
        return "plain"
    return f"{tuple(p.device_mesh.mesh.shape)} {p.device_mesh.mesh.flatten().tolist()} {tuple(p.placements)}"


def _local(p):
    return p.to_local() if hasattr(p, "to_local") else p


def native(root, rank, world):
    """Each (model, layout): transformers' own loading once, then shardcast's through every source in
    SOURCES (a comma list; else SOURCE alone, or auto), each compared with it. With several sources each
    result's key ends in " @<source>"."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig
    layouts = json.loads(os.environ["LAYOUTS"])
    sources = os.environ["SOURCES"].split(",") if os.environ.get("SOURCES") else [os.environ.get("SOURCE")]
    out = {}
    for name in sorted(os.listdir(root)):
        ckpt = os.path.join(root, name)
        for spec in layouts:
            key = f"{name} {spec}"
            ref, why = None, ""
            try:
                ref = AutoModelForCausalLM.from_pretrained(ckpt, distributed_config=DistributedConfig(**spec),
                                                           dtype=torch.bfloat16)
            except Exception as e:  # noqa: BLE001 -- a layout transformers itself does not take for this model
                why = f"transformers: {type(e).__name__}: {str(e)[:300]}"
                print(f"rank {rank} {key}: {why}", flush=True)
            ok = torch.tensor([0 if ref is None else 1])
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank compares the same way
            if not ok.item():  # a layout transformers' own loading fails on: against DTensor's split instead
                why = why or "transformers failed on another rank"
                full = dict(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).named_parameters())
            for source in sources:
                at = key if len(sources) == 1 else f"{key} @{source}"
                if ref is None or not ok.item():
                    out[at] = _against_split(ckpt, spec, source, full, why, rank)
                else:
                    out[at] = _against_transformers(ckpt, spec, source, ref, rank)
            del ref
    return out


def _against_split(ckpt, spec, source, full, why, rank):
    from transformers.distributed import DistributedConfig
    try:
        model = shardcast.from_pretrained(ckpt, distributed_config=DistributedConfig(**spec),
                                          source=source, verify=True, chunk_bytes=4096, timeout=60)
    except Exception as e:  # noqa: BLE001 -- the same layout transformers cannot build either
        return {"skipped": f"{why}; shardcast: {type(e).__name__}: {str(e)[:200]}"}
    bad, checked, layouts_seen = [], 0, set()
    for pname, p in model.named_parameters():
        layouts_seen.add(_describe(p))
        want = split_reference(full[pname].detach(), tuple(p.device_mesh.mesh.shape), p.placements,
                               p.device_mesh.get_coordinate()) if hasattr(p, "device_mesh") else full[pname]
        got = _local(p)
        if got.shape != want.shape or not torch.equal(_bits(got), _bits(want)):
            bad.append(f"{pname}: local {tuple(got.shape)} differs from DTensor's split {tuple(want.shape)}")
        checked += 1
    return {"checked": checked, "bad": bad, "layouts": sorted(layouts_seen), "native": why[:200],
            "verify": model.shardcast_report["ranks"][rank]["verify"], "source": model.shardcast_report["source"]}


def _against_transformers(ckpt, spec, source, ref, rank):
    from transformers.distributed import DistributedConfig
    model = shardcast.from_pretrained(ckpt, distributed_config=DistributedConfig(**spec), source=source,
                                      verify=True, chunk_bytes=4096, timeout=60)
    ref_params = dict(ref.named_parameters())
    bad, checked, layouts_seen = [], 0, set()
    for pname, p in model.named_parameters():
        r = ref_params.get(pname)
        if r is None:
            bad.append(f"{pname}: not in transformers' model")
            continue
        if _describe(p) != _describe(r):
            bad.append(f"{pname}: layout {_describe(p)} but transformers' {_describe(r)}")
            continue
        layouts_seen.add(_describe(p))
        a, b = _local(p), _local(r)
        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(_bits(a), _bits(b)):
            bad.append(f"{pname}: local {tuple(a.shape)} {a.dtype} differs from transformers' "
                       f"{tuple(b.shape)} {b.dtype}")
        checked += 1
    report = model.shardcast_report
    return {"checked": checked, "bad": bad, "layouts": sorted(layouts_seen),
            "verify": report["ranks"][rank]["verify"], "source": report["source"]}


def manual(root, rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import AutoConfig, AutoModelForCausalLM
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    out = {}
    for name in sorted(os.listdir(root)):
        ckpt = os.path.join(root, name)
        config = AutoConfig.from_pretrained(ckpt)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        shardcast.prepare(model, config=config)
        plan = {}
        for i, _ in enumerate(model.model.layers):
            for proj in ("q_proj", "k_proj", "v_proj"):
                plan[f"model.layers.{i}.self_attn.{proj}"] = ColwiseParallel()
            plan[f"model.layers.{i}.self_attn.o_proj"] = RowwiseParallel()
            plan[f"model.layers.{i}.mlp.gate_proj"] = ColwiseParallel()
            plan[f"model.layers.{i}.mlp.up_proj"] = ColwiseParallel()
            plan[f"model.layers.{i}.mlp.down_proj"] = RowwiseParallel()
        parallelize_module(model, mesh["tp"], plan)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        report = shardcast.load(model, ckpt, verify=True, chunk_bytes=4096, source=os.environ.get("SOURCE"))
        ref = dict(AutoModelForCausalLM.from_pretrained(ckpt).named_parameters())
        bad, checked, layouts_seen = [], 0, set()
        for pname, p in model.named_parameters():
            full = ref[pname].detach()
            if isinstance(p, DTensor):
                layouts_seen.add(str(tuple(p.placements)))
                coord = p.device_mesh.get_coordinate()
                want = split_reference(full, tuple(p.device_mesh.mesh.shape), p.placements, coord)
                got = p.to_local()
            else:
                want, got = full, p
            if got.shape != want.shape or not torch.equal(_bits(got), _bits(want)):
                bad.append(f"{pname} {tuple(p.placements) if isinstance(p, DTensor) else ''}: "
                           f"local {tuple(got.shape)} vs {tuple(want.shape)}")
            checked += 1
        saved = os.path.join(os.environ["SAVE_ROOT"], name)
        shardcast.save(model, saved, source=os.environ.get("SAVE_MODE", "each-rank"), overwrite=True)
        dist.barrier()
        back = dict(AutoModelForCausalLM.from_pretrained(saved).named_parameters())
        resaved_bad = [k for k, v in ref.items() if not torch.equal(_bits(v), _bits(back[k]))]
        out[name] = {"checked": checked, "bad": bad, "layouts": sorted(layouts_seen), "saved_bad": resaved_bad,
                     "verify": report["ranks"][rank]["verify"]}
        del model
    return out


def main():
    mode, root, out_path = sys.argv[1], sys.argv[2], sys.argv[3]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        modes = {"native": native, "manual": manual}  # MODE scenarios: several in turn (ranks.each_scenario)
        ranks.each_scenario(mode, root, lambda name, where: modes[name](where, rank, world), f"{out_path}.{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
