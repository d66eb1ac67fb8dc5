"""What the quantized-format test workers (fp8_worker.py, mxfp4_worker.py, nvfp4_worker.py) share: a rank's
rows of an FSDP2 Shard(0), the bf16 FSDP2 model of a quantized checkpoint, the malformed-checkpoint loop and
the worker's entry point; and what their tests (test_mxfp4.py, test_nvfp4.py) share: the checkpoints they
write and the check that a malformed one is the same error on every rank."""
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

import ranks
import shardcast


def rows(n, world, rank):
    """This rank's rows [begin, end) of n under FSDP2's Shard(0) (torch.chunk: ceil(n / world) each)."""
    chunk = -(-n // world)
    begin = min(n, rank * chunk)
    return begin, min(n, begin + chunk)


def packed(full, path, rank, world):
    """The explicit mapping of every stored tensor (but 0-dim ones) into a tensor of its own dtype, rows
    under FSDP2's rule, both sources: the quantized bytes kept as stored, never paired or dequantized."""
    out = {}
    for source in ("rank0", "each-rank"):
        m = {}
        for key, t in full.items():
            if t.dim() > 0:
                b, e = rows(t.shape[0], world, rank)
                m[key] = (torch.empty((e - b,) + tuple(t.shape[1:]), dtype=t.dtype), b, e)
        report = shardcast.load(m, path, source=source, verify=True, chunk_bytes=4096)
        out[f"{source}/packed"] = {
            "bad": [k for k, (t, b, e) in m.items()
                    if not torch.equal(t.view(torch.uint8), full[k][b:e].contiguous().view(torch.uint8))],
            "checked": len(m), "dequantized": report["dequantized"], "skipped": report["skipped_keys"],
            "dtypes": sorted({str(t.dtype) for t, _, _ in m.values()})}
    return out


def shards_against(model, want):
    """Each parameter's local shard against DTensor's piece of want[name] (the whole tensor), bit for bit:
    (names that differ or have no reference, local dtypes seen, names sharded on some mesh dim)."""
    from dtensor_ref import split_reference
    bad, dtypes, sharded = [], set(), []
    for n, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        ref = want.get(n)
        if ref is None:
            bad.append(n)
            continue
        if hasattr(p, "to_local"):
            ref = split_reference(ref, tuple(p.device_mesh.shape), p.placements, p.device_mesh.get_coordinate())
            if any(type(x).__name__ != "Replicate" for x in p.placements):
                sharded.append(n)
        dtypes.add(str(local.dtype))
        if local.dtype != ref.dtype or local.shape != ref.shape or not torch.equal(
                local.detach().contiguous().view(torch.uint8), ref.contiguous().view(torch.uint8)):
            bad.append(n)
    return bad, sorted(dtypes), sharded


def bf16_fsdp2(ckpt, world):
    """The one-line user flow: the checkpoint's config without quantization_config, a bf16 model on the
    meta device, shardcast.prepare, fully_shard of every decoder layer and the root on a CPU mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(ckpt)
    del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    shardcast.prepare(model, config=config)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def malformed_errors(root, mapping_for):
    """Each checkpoint under ROOT/malformed, loaded into mapping_for(its path) on this rank: the exception
    class and message ({"type": None} where it loaded)."""
    base = os.path.join(root, "malformed")
    out = {}
    for name in sorted(os.listdir(base)):
        path = os.path.join(base, name)
        mapping = mapping_for(path)
        try:
            shardcast.load(mapping, path, timeout=60)
            out[name] = {"type": None}
        except shardcast.ShardcastError as err:
            out[name] = {"type": type(err).__name__, "message": str(err)}
    return out


def write_two_files(path, first, second):
    """A checkpoint in two files with an index: the tensors of `first` in one, those of `second` in the other."""
    from safetensors.torch import save_file
    names = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": second}
    path.mkdir()
    weight_map = {}
    for name, tensors in names.items():
        save_file(tensors, str(path / name))
        weight_map.update({k: name for k in tensors})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def write_cases(root, cases):
    """One single-file checkpoint ROOT/NAME per case NAME: its tensors."""
    from safetensors.torch import save_file
    for name, tensors in cases.items():
        (root / name).mkdir(parents=True)
        save_file(tensors, str(root / name / "model.safetensors"))


def assert_one_error_everywhere(results, says, kind="CheckpointError"):
    """Every rank's result["malformed"][NAME] is the same `kind` and message, holding every word of says[NAME]."""
    for name, words in says.items():
        seen = [r["malformed"][name] for r in results]
        assert all(s["type"] == kind for s in seen), (name, seen)
        assert len({s["message"] for s in seen}) == 1, (name, seen)  # the same on every rank
        for w in words:
            assert w in seen[0]["message"], (name, w, seen[0]["message"])


def run(modes, all_names, timeout_s=120, backend="gloo"):
    """`python WORKER.py MODE ROOT OUT` under torchrun's variables: MODE ("all": all_names(world)) run
    on this rank, each as modes[name](root, rank, world), the results written as JSON to OUT.<rank> as
    {name: result}; MODE `scenarios`: several such MODEs in turn (ranks.each_scenario).
    backend: init_process_group's, or a callable(MODE) giving it."""
    mode, root, out_path = sys.argv[1:4]
    backend = backend(mode) if callable(backend) else backend
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()

    def one(name, where):
        return {n: modes[n](where, rank, world) for n in (all_names(world) if name == "all" else [name])}
    ranks.each_scenario(mode, root, one, f"{out_path}.{rank}")
    dist.destroy_process_group()
