"""One rank of the save tests: `python save_worker.py all ROOT OUT` as 4 ranks under torchrun's variables.
ROOT holds save_pretrained checkpoints (one dir per model) and `earlier` (an out_dir a killed save must
leave intact); saved checkpoints go under OUT-saved/, and each rank's results to OUT.<rank> (JSON,
rewritten after every scenario, so a rank killed in the last one still reports the others).

roundtrip: for world sizes 1-4 (sub-groups of the first W ranks; the others wait): each model loaded
           with shardcast into FSDP2 (meta -> prepare -> fully_shard -> load), then saved with shardcast
           in both modes, each into its own out_dir (checked by the test).
errors:    every failure here is agreed by verdict, so the process group stays in step: an existing
           out_dir without overwrite; a leftover tmp dir named, then removed with overwrite (with
           dtype=float32 on the way out); a Shard(1) weight saved and read back; a Partial placement; a full disk
           on rank 1 (RLIMIT_FSIZE) mid-write.
kill:      last: rank 1 kills itself (SIGKILL) after its first rows were written, while the ranks save
           over ROOT/earlier with overwrite=True.
"""
import datetime
import json
import os
import resource
import signal
import sys
import time

import torch
import torch.distributed as dist

import ranks
import shardcast

MODELS = ["qwen3_moe", "mixtral", "llama", "deepseek_v3"]


def loaded(root, name, group):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM
    ckpt = os.path.join(root, name)
    config = AutoConfig.from_pretrained(ckpt)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shardcast.prepare(model, config=config)
    mesh = DeviceMesh.from_group(group, "cpu")
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    shardcast.load(model, ckpt, process_group=group)
    return model


def catch(call):
    return ranks.shardcast_error(call)


def summary(report, rank):
    r = report["ranks"][rank]
    return {"files": report["files"], "total_bytes": report["total_bytes"], "written": r["bytes_written"],
            "sent": r["bytes_sent"], "received": r["bytes_received"],
            "written_by_all": sum(x["bytes_written"] for x in report["ranks"])}


def roundtrip(root, saved, rank, world, models):
    out = {}
    for w in range(1, world + 1):
        group = dist.group.WORLD if w == world else dist.new_group(ranks=list(range(w)))
        if rank < w:
            for name in MODELS:
                model = loaded(root, name, group)
                if w == world:
                    models[name] = model
                for mode in ("each-rank", "rank0"):
                    report = shardcast.save(model, os.path.join(saved, f"w{w}", f"{name}-{mode}"), source=mode,
                                            max_shard_size="30KB", process_group=group, timeout=60)
                    out[f"w{w}/{name}-{mode}"] = summary(report, rank)
        dist.barrier()
    return out


def errors(root, saved, rank, world, models):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    qwen = models["qwen3_moe"]
    out_dir = os.path.join(saved, f"w{world}", "qwen3_moe-each-rank")
    res = {"exists": catch(lambda: shardcast.save(qwen, out_dir, timeout=60))}
    fresh = os.path.join(saved, "fresh")
    leftover = fresh + ".tmp-1234-dead"
    if rank == 0:
        os.makedirs(os.path.join(leftover, "junk"))
    dist.barrier()
    res["leftover"] = catch(lambda: shardcast.save(qwen, fresh, timeout=60))
    res["overwrite_f32"] = catch(lambda: shardcast.save(qwen, fresh, source="rank0", dtype=torch.float32,
                                                        overwrite=True, max_shard_size="30KB", timeout=60))
    res["leftover_exists"] = os.path.exists(leftover)
    # saved over again, with a tokenizer and a folder of the user's beside the model: they stay (save
    # removed every other file of out_dir); the model's old shards of another count do not
    if rank == 0:
        with open(os.path.join(fresh, "tokenizer.json"), "w") as f:
            f.write("{}")
        os.makedirs(os.path.join(fresh, "notes"))
        with open(os.path.join(fresh, "notes", "run.txt"), "w") as f:
            f.write("kept")
    dist.barrier()
    res["overwrite_kept"] = catch(lambda: shardcast.save(qwen, fresh, dtype=torch.float32, overwrite=True,
                                                         timeout=60))
    res["listing_after_overwrite"] = sorted(os.listdir(fresh))

    mesh = init_device_mesh("cpu", (world,))
    from torch.distributed.tensor import DTensor, Partial
    odd = torch.nn.Linear(8, 6, bias=False)  # Shard(1): one run per row, each written at its place
    full_odd = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    odd.weight = torch.nn.Parameter(distribute_tensor(full_odd, mesh, [Shard(1)]))
    res["shard1"] = catch(lambda: shardcast.save(odd, os.path.join(saved, "odd"), timeout=60))
    dist.barrier()
    from safetensors.torch import load_file
    res["shard1_back"] = torch.equal(load_file(os.path.join(saved, "odd", "model.safetensors"))["weight"], full_odd)
    partial = torch.nn.Linear(8, 6, bias=False)  # a Partial placement has no checkpoint value
    partial.weight = torch.nn.Parameter(DTensor.from_local(torch.ones(6, 8), mesh, [Partial()]))
    res["placement"] = catch(lambda: shardcast.save(partial, os.path.join(saved, "partial"), timeout=60))
    res["placement_left"] = os.path.exists(os.path.join(saved, "partial"))

    full = os.path.join(saved, "full")
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:  # Python ignores SIGXFSZ: the write fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (20000, old[1]))
    try:
        res["disk_full"] = catch(lambda: shardcast.save(qwen, full, max_shard_size="10MB", timeout=60))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
    res["disk_full_left"] = sorted(n for n in os.listdir(saved) if n.startswith("full"))
    return res


def kill(root, saved, rank, world, models):
    def die(done, total):
        if rank == 1 and done > 0:  # after this rank's first rows reached the file
            os.kill(os.getpid(), signal.SIGKILL)
    return catch(lambda: shardcast.save(models["qwen3_moe"], os.path.join(root, "earlier"), overwrite=True,
                                        max_shard_size="30KB", chunk_bytes="4K", progress=die, timeout=5))


def main():
    _, root, out_path = sys.argv[1:4]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    saved = f"{out_path}-saved"
    models, result = {}, {}
    for name, scenario in (("roundtrip", roundtrip), ("errors", errors), ("kill", kill)):
        result[name] = scenario(root, saved, rank, world, models)
        with open(f"{out_path}.{rank}", "w") as f:
            json.dump(result, f)
    if rank == 0:  # it hosts the store: keep it up until every survivor fetched the published failure
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(_reported(f"{out_path}.{r}") for r in range(2, world)):
            time.sleep(0.1)
    os._exit(0)  # the kill scenario leaves the process group broken: no teardown


def _reported(path):
    try:
        with open(path) as f:
            return "kill" in json.load(f)
    except (OSError, ValueError):
        return False


if __name__ == "__main__":
    main()
