"""One rank of test_materialize: `python materialize_worker.py MODE ROOT OUT` with torchrun's variables.

MODE cpu (world 4, Gloo, CPU meshes), every scenario in this one launch, each reported on its own:
  lazy_zero_1d      a two-Linear model (rows 4099 and 1003: uneven over 4, the last rank's shard padded by
                    FSDP2) fully_shard'ed on meta over a 1-d mesh, materialized as load materializes it:
                    RssAnon before and after (from /proc/self/status), the shards read as zeros, then
                    shardcast.load: every local shard bit-exact against the checkpoint, and FSDP2's own
                    unshard (its padded buffer) gives the checkpoint's full tensors
  lazy_zero_hsdp    the same over a 2x2 (replicate, shard) mesh
  pretrained_hsdp   shardcast.from_pretrained(mesh=2x2 mesh) against transformers' from_pretrained + the same
                    fully_shard calls (pretrained_worker.compare), bit for bit, for ROOT/hf's tiny models
  device            the CPU-side decisions: a model on a CPU mesh loads into CPU shards, and from_pretrained's
                    default target is the host where this rank has no GPU (CUDA where it has one)
  teardown          the last step: a load, the result written, then dist.destroy_process_group() at once (no
                    del, gc.collect() or barrier) and exit: the test checks every rank exits 0
MODE cuda (world 1, a CUDA device): the device follows the model (a CUDA mesh loads into cuda:LOCAL_RANK
  with no target; target="cpu" there is an InvalidArgument; from_pretrained defaults to CUDA).
"""
import datetime
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

import shardcast

HERE = os.path.dirname(os.path.abspath(__file__))
IN, ROWS_A, ROWS_B = 1000, 4099, 1003


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def checkpoint_tensors(path):
    from safetensors.torch import load_file
    return load_file(os.path.join(path, "model.safetensors"))


def plain_model(mesh, fsdp_kwargs=None):
    from torch.distributed.fsdp import fully_shard
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(IN, ROWS_A), torch.nn.Linear(ROWS_A, ROWS_B))
    for layer in model:
        fully_shard(layer, mesh=mesh, **(fsdp_kwargs or {}))
    fully_shard(model, mesh=mesh, **(fsdp_kwargs or {}))
    return model


def exact_shards(model, expected) -> list:
    """Names whose local shard differs from the checkpoint's piece DTensor gives this rank."""
    from torch.distributed.tensor import distribute_tensor
    bad = []
    for name, p in model.named_parameters():
        # src_data_rank=None: each rank slices its own piece, no collective
        want = distribute_tensor(expected[name], p.device_mesh, p.placements, src_data_rank=None).to_local()
        if not torch.equal(p.to_local().view(torch.uint8), want.view(torch.uint8)):
            bad.append(name)
    return bad


def unsharded_exact(model, expected) -> list:
    """Names whose FSDP2 all-gather (from FSDP2's own padded buffer) differs from the checkpoint."""
    from torch.distributed.fsdp import FSDPModule
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.unshard()
    bad = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), expected[n])]
    for unit in units:
        unit.reshard()
    return bad


def lazy_zero(mesh, path, expected):
    import gc
    from shardcast._load import _materialize
    model = plain_model(mesh)
    gc.collect()
    before = rss_anon()
    _materialize(model, None, None, None)  # what shardcast.load does first with a model on meta
    after = rss_anon()
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    zeros = all(int(torch.count_nonzero(p.to_local())) == 0 for p in model.parameters())
    after_read = rss_anon()
    report = shardcast.load(model, path, verify=True)
    after_load = rss_anon()
    return {"shard_bytes": shard_bytes, "grew_materialize": after - before, "grew_reading_zeros": after_read - after,
            "grew_load": after_load - after_read, "zeros": zeros,
            "local_rows": [p.to_local().shape[0] for p in model.parameters()],
            "bad_shards": exact_shards(model, expected), "bad_unsharded": unsharded_exact(model, expected),
            "verify": report["ranks"][dist.get_rank()]["verify"]}


def pretrained_hsdp(mesh2d, root):
    sys.path.insert(0, HERE)
    import pretrained_worker
    return {name: pretrained_worker.compare(name, os.path.join(root, name), os.path.join(root, name), mesh2d, {})
            for name in sorted(os.listdir(root))}


def device_decisions(mesh, path):
    from shardcast._pretrained import _pretrained_target
    model = plain_model(mesh)
    shardcast.load(model, path)
    local = int(os.environ["LOCAL_RANK"])
    gpu = torch.cuda.is_available() and local < torch.cuda.device_count()
    return {"gpu_for_local_rank": gpu, "default_target": _pretrained_target(None, None),
            "mesh_target": _pretrained_target(None, mesh),
            "shard_devices": sorted({str(p.to_local().device) for p in model.parameters()})}


def teardown_load(mesh, path, expected):
    """A script's last lines: a load, then (in cpu()) destroy_process_group; the model stays alive, with no
    del, gc.collect() or barrier before it."""
    global last_model
    last_model = plain_model(mesh)
    shardcast.load(last_model, path)
    return {"bad_shards": exact_shards(last_model, expected)}


def scenario(results, name, fn, *args):
    try:
        results[name] = fn(*args)
    except Exception as e:  # noqa: BLE001 -- reported per scenario; the test names it
        results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}


def cpu(root, out_path):
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    world = dist.get_world_size()
    path = os.path.join(root, "plain")
    expected = checkpoint_tensors(path)
    mesh = init_device_mesh("cpu", (world,))
    mesh2d = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    results = {}
    scenario(results, "lazy_zero_1d", lazy_zero, mesh, path, expected)
    scenario(results, "lazy_zero_hsdp", lazy_zero, mesh2d, path, expected)
    scenario(results, "pretrained_hsdp", pretrained_hsdp, mesh2d, os.path.join(root, "hf"))
    scenario(results, "device", device_decisions, mesh, path)
    scenario(results, "teardown", teardown_load, mesh, path, expected)
    with open(f"{out_path}.{dist.get_rank()}", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def cuda(root, out_path):
    from torch.distributed.device_mesh import init_device_mesh
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("cpu:gloo,cuda:nccl", timeout=datetime.timedelta(seconds=120))
    path = os.path.join(root, "plain")
    expected = {k: v.cuda() for k, v in checkpoint_tensors(path).items()}
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    results = {}

    def follows():
        model = plain_model(mesh)
        shardcast.load(model, path)
        return {"devices": sorted({str(p.to_local().device) for p in model.parameters()}),
                "bad_shards": exact_shards(model, expected), "bad_unsharded": unsharded_exact(model, expected)}

    def cpu_target():
        try:
            shardcast.load(plain_model(mesh), path, target="cpu", timeout=60)
        except shardcast.ShardcastError as e:
            return {"raised": type(e).__name__, "message": str(e)}
        return {"raised": None}

    def pretrained():
        model = shardcast.from_pretrained(os.path.join(root, "hf", "llama"))
        return {"devices": sorted({str(p.to_local().device) for p in model.parameters()}),
                "mesh": model.model.embed_tokens.weight.device_mesh.device_type}

    scenario(results, "follows_mesh", follows)
    scenario(results, "cpu_target_into_cuda_mesh", cpu_target)
    scenario(results, "pretrained_default", pretrained)
    with open(f"{out_path}.{dist.get_rank()}", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    mode, root, out = sys.argv[1:4]
    {"cpu": cpu, "cuda": cuda}[mode](root, out)
