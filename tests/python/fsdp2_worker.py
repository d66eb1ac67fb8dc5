"""One rank of the Python tests: `python fsdp2_worker.py MODE ROOT OUT` with torchrun's variables set.

MODE flow:     for every model under ROOT: meta model -> shardcast.prepare -> fully_shard on a CPU mesh
               -> shardcast.load; every local shard is compared bit-exactly with transformers'
               own from_pretrained of the same checkpoint, every non-persistent buffer with what
               transformers computes. With TEST_PRETRAINED set, each model also through
               shardcast.from_pretrained streaming beside the build, bit for bit against it.
MODE mapping:  the explicit {key: (local, begin, end)} path, no DTensor.
MODE mapping_boxes: the explicit {key: (local, offsets)} path: boxes no DTensor layout makes.
MODE mapping_bad_box: rank 1's box reaches past the tensor; every rank must raise the same error.
MODE mismatch: rank 1 builds a different model; every rank must raise the same ManifestMismatch.
MODE keys_fail: rank 0 fails while working out which checkpoint tensors make the fused experts; every
               rank must raise the same error, naming rank 0.
MODE keys_freeze: rank 0 freezes there instead (it never publishes them, never reaches the handshake);
               every other rank must fail within its timeouts, naming rank 0, and end.

MODE scenarios: several of these modes in turn, in these processes (ranks.each_scenario).

Every mode counts this rank's reads of the checkpoint's keys (index and headers, in Python): only rank 0
may read them; the others get what the load needs from it.
"""
import datetime
import os
import sys

import torch
import torch.distributed as dist

import ranks
import shardcast

KEY_READS = [0]
_checkpoint_keys = shardcast._load.checkpoint_keys


def _counted_checkpoint_keys(path):
    KEY_READS[0] += 1
    return _checkpoint_keys(path)


shardcast._load.checkpoint_keys = _counted_checkpoint_keys


def rows(n, world, rank):  # FSDP2's dim-0 rule, written out independently
    chunk = -(-n // world)
    begin = min(n, rank * chunk)
    return begin, min(n, begin + chunk)


def ulps(a, b):
    ia, ib = a.float().view(torch.int32).long(), b.float().view(torch.int32).long()
    return int((ia - ib).abs().max()) if a.numel() else 0


def flow(root, rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    KEY_READS[0] = 0  # the scenarios before this one in the same processes read keys too
    for name in sorted(os.listdir(root)):
        ckpt = os.path.join(root, name)
        config = AutoConfig.from_pretrained(ckpt)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        prep = shardcast.prepare(model, config=config)
        for layer in shardcast._world.shard_units(model):  # the decoder layers, wherever the model keeps them
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        report = shardcast.load(model, ckpt, verify=True, chunk_bytes=4096)
        ref = AutoModelForCausalLM.from_pretrained(ckpt)
        ref_params, ref_buffers = dict(ref.named_parameters()), dict(ref.named_buffers())
        bad, checked = [], 0
        for pname, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            full = ref_params[pname].detach()
            b, e = rows(full.shape[0], world, rank)
            if not torch.equal(local.detach().view(torch.uint8) if local.numel() else local, full[b:e].view(torch.uint8)
                               if local.numel() else full[b:e]):
                bad.append(pname)
            checked += 1
        for bname, buf in model.named_buffers():
            if ulps(buf, ref_buffers[bname]) > 1:
                bad.append(f"{bname} ({ulps(buf, ref_buffers[bname])} ulp)")
            checked += 1
        out[name] = {"checked": checked, "bad": bad, "computed": sorted(prep["computed_buffers"]),
                     "verify": report["ranks"][rank]["verify"], "skipped": report["skipped_keys"],
                     "entries": report["entries"], "key_reads": KEY_READS[0],
                     "dcp": through_dcp(ckpt, config, model, mesh)}
        if os.environ.get("TEST_PRETRAINED"):
            out[name]["pretrained"] = through_pretrained(ckpt, model, mesh)
        KEY_READS[0] = 0
    return out


def through_dcp(ckpt, config, loaded, mesh):
    """The same FSDP2 layout filled by dcp.load through torch's HuggingFaceStorageReader and through
    shardcast.dcp's, each compared bit for bit with `loaded` (shardcast.load's, checked against
    transformers): [(reader, key)] that differ. Where transformers' module names are not the checkpoint's
    keys (experts it fuses, tied weights the file omits), DCP needs a StateDictAdapter, as torchtitan's:
    "keys differ" then, for both readers alike."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    import shardcast.dcp as sdcp
    from dtensor_ref import sentinel_fsdp_model
    stored = {k for k, *_ in shardcast._shardcast.checkpoint_tensors(ckpt)}
    want = loaded.state_dict()
    if not set(want) <= stored:
        return "keys differ"
    differ = []
    for reader in (HuggingFaceStorageReader(ckpt), sdcp.HuggingFaceStorageReader(ckpt)):
        got = sentinel_fsdp_model(config, mesh).state_dict()
        dcp.load(got, storage_reader=reader)
        for key, t in want.items():
            a, b = (x.to_local() if hasattr(x, "to_local") else x for x in (t, got[key]))
            if a.dtype != b.dtype or not torch.equal(a.view(torch.uint8) if a.numel() else a,
                                                     b.view(torch.uint8) if b.numel() else b):
                differ.append((type(reader).__module__.split(".")[0], key))
    return differ


def through_pretrained(ckpt, loaded, mesh):
    """shardcast.from_pretrained of the same checkpoint asked to stream beside the build (float32, the
    checkpoint's dtype; `flow`'s CPU mesh and its default layout, `flow`'s: fully_shard of each decoder
    layer, then of the root),
    compared bit for bit with `loaded` (`flow`'s, checked against transformers): {"beside": whether it
    streamed beside the build (an architecture whose layout the header does not give loads after it),
    "differ": names whose local shard, placement or buffer differs}."""
    def local(t):
        t = t.detach()
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else t

    model = shardcast.from_pretrained(ckpt, mesh=mesh, dtype=torch.float32, stream_beside_build=True, timeout=120)
    differ = []
    for kind, want, got in (("parameter", dict(loaded.named_parameters()), dict(model.named_parameters())),
                            ("buffer", dict(loaded.named_buffers()), dict(model.named_buffers()))):
        differ += [f"{kind} {n} (missing)" for n in sorted(set(want) ^ set(got))]
        for n in sorted(set(want) & set(got)):
            a, b = want[n], got[n]
            if a.dtype != b.dtype or getattr(a, "placements", None) != getattr(b, "placements", None) or \
                    tuple(a.shape) != tuple(b.shape) or not torch.equal(local(a), local(b)):
                differ.append(f"{kind} {n}")
    return {"beside": model.shardcast_report.stream_beside_build, "differ": differ}


def hsdp(root, rank, world):
    """A 2 x (W/2) HSDP mesh (replicate x shard) over two nodes: every source, every rank's local shard
    equals the rows of its shard index in transformers' own from_pretrained."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM
    replicas, shards = 2, world // 2
    mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    out = {}
    for name in ("qwen3_moe", "deepseek_v3"):
        ckpt = os.path.join(root, name)
        config = AutoConfig.from_pretrained(ckpt)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        shardcast.prepare(model, config=config)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        ref = dict(AutoModelForCausalLM.from_pretrained(ckpt).named_parameters())
        for source in ("rank0", "each-rank", "node-leader", "striped"):
            for _, p in model.named_parameters():  # a fresh target: nothing left from the previous source
                (p.to_local() if hasattr(p, "to_local") else p).data.zero_()
            report = shardcast.load(model, ckpt, source=source, verify=True)
            bad = []
            for pname, p in model.named_parameters():
                local = (p.to_local() if hasattr(p, "to_local") else p).detach()
                b, e = rows(ref[pname].shape[0], shards, rank % shards)
                if not torch.equal(local.view(torch.uint8), ref[pname].detach()[b:e].view(torch.uint8)):
                    bad.append(pname)
            reads = sum(r["bytes_read"] for r in report["ranks"]) / report["checkpoint_bytes"]
            out[f"{name}/{source}"] = {"bad": bad, "mesh": report["mesh"], "nodes": report["nodes"],
                                       "reads": reads, "verify": report["ranks"][rank]["verify"]}
    return out


def fault(root, rank, world):
    """SHARDCAST_FAULT kills or freezes rank 0 (the store host) mid-stream: every survivor raises the
    same exception class and message, naming rank 0, within the timeout."""
    import time
    ckpt, model = _sharded_qwen3_moe(root, world)
    t0 = time.monotonic()
    try:
        shardcast.load(model, ckpt, timeout=8, chunk_bytes=4096)  # 3 s timed out before the fault under load ~20
    except shardcast.ShardcastError as e:
        return {"type": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t0}
    return {"type": None, "seconds": time.monotonic() - t0}


def _sharded_qwen3_moe(root, world):
    """(checkpoint, model): ROOT's qwen3_moe built on meta, prepared and fully_shard-ed over all ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM
    mesh = init_device_mesh("cpu", (world,))
    ckpt = os.path.join(root, "qwen3_moe")
    config = AutoConfig.from_pretrained(ckpt)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shardcast.prepare(model, config=config)
    fully_shard(model, mesh=mesh)
    return ckpt, model


def _first_checkpoint(root):
    """(path, {key: tensor}) of the first checkpoint under ROOT, read whole with safetensors."""
    from safetensors.torch import load_file
    ckpt = os.path.join(root, sorted(os.listdir(root))[0])
    full = {}
    for f in sorted(os.listdir(ckpt)):
        if f.endswith(".safetensors"):
            full.update(load_file(os.path.join(ckpt, f)))
    return ckpt, full


def mapping(root, rank, world):
    ckpt, full = _first_checkpoint(root)
    wanted = sorted(full)[:6]
    m = {}
    for k in wanted:
        b, e = rows(full[k].shape[0], world, rank)
        m[k] = (torch.empty((e - b,) + tuple(full[k].shape[1:]), dtype=full[k].dtype), b, e)
    shardcast.load(m, ckpt, verify=True)
    bad = [k for k, (t, b, e) in m.items() if not torch.equal(t, full[k][b:e])]
    return {"checked": len(m), "bad": bad}


def _boxes(shape, rank, world, kind):
    """(offsets, sizes) of this rank's box, by a rule unlike any DTensor layout: uneven columns, a
    rank with nothing, overlapping boxes, or a 2-d block grid."""
    if kind == "columns" and len(shape) == 2:  # rank r takes columns [c_r, c_{r+1}), widths 1, 2, 3, ...
        cuts = [min(shape[1], r * (r + 1) // 2) for r in range(world)] + [shape[1]]
        return (0, cuts[rank]), (shape[0], cuts[rank + 1] - cuts[rank])
    if kind == "overlap":  # every rank the first half of rows, plus its own extra row
        half = shape[0] // 2
        extra = min(shape[0] - half, rank + 1)
        return (0,) + (0,) * (len(shape) - 1), (half + extra,) + tuple(shape[1:])
    if kind == "empty":  # only the last rank holds anything: the whole tensor
        whole = rank == world - 1
        return (0,) * len(shape), tuple(shape) if whole else (0,) * len(shape)
    # block: a 2-d grid, rows split in two, columns by rank parity, off the last row and column
    r0 = 0 if rank % 2 == 0 else shape[0] // 2
    return (r0,) + (1,) * (len(shape) - 1), (shape[0] // 2,) + tuple(max(0, n - 2) for n in shape[1:])


def mapping_boxes(root, rank, world):
    """The explicit box form {key: (local, offsets)}: any box of the global tensor, every rank bit-exact."""
    ckpt, full = _first_checkpoint(root)
    kinds = ["columns", "overlap", "empty", "block"]
    m, want = {}, {}
    for i, k in enumerate(sorted(full)):
        if full[k].dim() < 2:
            continue
        offsets, sizes = _boxes(tuple(full[k].shape), rank, world, kinds[i % len(kinds)])
        m[k] = (torch.full(sizes, float("nan"), dtype=full[k].dtype), offsets)
        want[k] = full[k][tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]
    report = shardcast.load(m, ckpt, verify=True)
    bad = [k for k, (t, _) in m.items() if t.shape != want[k].shape or not torch.equal(t, want[k])]
    return {"checked": len(m), "bad": bad, "verify": report["ranks"][rank]["verify"], "mesh": report["mesh"]}


def mapping_bad_box(root, rank, world):
    """Rank 1's box reaches past the tensor: refused by name on every rank."""
    ckpt, full = _first_checkpoint(root)
    key = next(k for k in sorted(full) if full[k].dim() == 2)
    rows_, cols = full[key].shape
    offsets = (rows_ - 1, 0) if rank == 1 else (0, 0)
    m = {key: (torch.empty((2, cols), dtype=full[key].dtype), offsets)}
    try:
        shardcast.load(m, ckpt, timeout=30)
    except shardcast.ShardcastError as e:
        return {"type": type(e).__name__, "message": str(e), "key": key}
    return {"type": None, "key": key}


def mapping_bad_rows(root, rank, world):
    """Rank 1 names rows of the right length at the wrong place: refused on every rank, never loaded."""
    ckpt, full = _first_checkpoint(root)
    key = sorted(full)[0]
    b, e = rows(full[key].shape[0], world, rank)
    if rank == 1:
        b, e = b - 1, e - 1
    m = {key: (torch.empty((e - b,) + tuple(full[key].shape[1:]), dtype=full[key].dtype), b, e)}
    try:
        shardcast.load(m, ckpt)
    except shardcast.ShardcastError as err:
        return {"type": type(err).__name__, "message": str(err), "key": key}
    return {"type": None, "key": key}


def mismatch(root, rank, world):
    from transformers import AutoConfig, AutoModelForCausalLM
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world,))
    ckpt = os.path.join(root, "llama")
    config = AutoConfig.from_pretrained(ckpt)
    if rank == 1:
        config.intermediate_size += 8  # this rank's model disagrees with the checkpoint and rank 0
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shardcast.prepare(model, config=config)
    fully_shard(model, mesh=mesh)
    try:
        shardcast.load(model, ckpt, timeout=30)
    except shardcast.ShardcastError as e:
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": None}


def _load_with_keys_on_rank0(root, rank, world, read_keys, timeout):
    """The sharded qwen3_moe loaded with rank 0's reading of the checkpoint's keys replaced by
    read_keys; this rank's error as {type, message}, or {type: None}."""
    ckpt, model = _sharded_qwen3_moe(root, world)
    if rank == 0:
        shardcast._load.checkpoint_keys = read_keys
    try:
        shardcast.load(model, ckpt, timeout=timeout)
    except shardcast.ShardcastError as e:
        return {"type": type(e).__name__, "message": str(e)}
    finally:  # the next scenario in these processes reads the keys for real
        shardcast._load.checkpoint_keys = _counted_checkpoint_keys
    return {"type": None}


def keys_fail(root, rank, world):
    def broken(path):
        raise OSError("index unreadable (injected)")
    return _load_with_keys_on_rank0(root, rank, world, broken, timeout=30)


def keys_freeze(root, rank, world):
    def frozen(path):
        import time
        time.sleep(3600)
    return _load_with_keys_on_rank0(root, rank, world, frozen, timeout=3)


def main():
    mode, root, out_path = sys.argv[1:4]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    modes = {"flow": flow, "mapping": mapping, "mapping_bad_rows": mapping_bad_rows, "mismatch": mismatch, "hsdp": hsdp, "fault": fault,
             "keys_fail": keys_fail, "keys_freeze": keys_freeze, "mapping_boxes": mapping_boxes, "mapping_bad_box": mapping_bad_box}
    ranks.each_scenario(mode, root, lambda name, where: modes[name](where, rank, world), f"{out_path}.{rank}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
