"""One rank of the DCP writer tests: `python dcp_writer_worker.py all ROOT OUT` as 3 or 4 ranks under torchrun's
variables. Every scenario saves the same state dict twice, with shardcast.dcp.HuggingFaceStorageWriter into
OUT-saved/<name> and with torch's HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True)
into OUT-saved/<name>-torch; rank 0 also writes the whole tensors (before sharding) to OUT-saved/<name>.truth
with safetensors' save_file. The test compares the three. Each rank's results go to OUT.<rank> (JSON,
rewritten after every scenario, so a rank killed in the last one still reports the others).

dims:      a 1-d mesh of all ranks: bf16 rows that do not divide (37), an fp32 matrix with an empty
           piece on the last rank, fp16 Shard(1), fp8 rows, a replicated DTensor and a plain tensor (kept
           by DCP on one rank); split by max_shard_size, then again by an fqn_to_index_mapping.
llama:     a tiny real transformers Llama, fully_shard'ed per layer; its dir already holds config.json
           (written first) which the save must keep; the test loads it with from_pretrained.
tp_fsdp:   (world 4) a 2x2 (dp, tp) mesh: Colwise up_proj (FSDP over TP: _StridedShard), Rowwise down_proj
           (Shard(1) pieces), a replicated bias.
errors:    a BytesIO item; a mapping that misses a key; one rank whose planner fails; dcp.save(use_collectives=False)
           into one directory: each raises on every rank.
kill:      (world 4, last) rank 1 kills itself after its first bytes were written, while the ranks save over
           the llama dir; the survivors must raise within the timeout and the llama dir stay as it was.
"""
import datetime
import hashlib
import io
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter as TorchWriter

from save_worker import _reported  # the kill scenario waits for the survivors as save_worker does
from shardcast.dcp._hf_writer import HuggingFaceStorageWriter


def tree_digest(d):
    h = hashlib.sha256()
    for base, dirs, files in sorted(os.walk(d)):
        dirs.sort()
        for f in sorted(files):
            p = os.path.join(base, f)
            h.update(os.path.relpath(p, d).encode())
            with open(p, "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


def outcome(fn):
    t0 = time.monotonic()
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 -- DCP wraps ours in CheckpointException; record either
        return {"type": type(e).__name__, "message": str(e)[:4000], "seconds": time.monotonic() - t0}
    return {"type": None, "seconds": time.monotonic() - t0}


def both(sd, saved, name, rank, truth, mapping=None, max_shard_size="5GB", group=None):
    """Saves sd with ours then torch's; rank 0 writes the truth. Returns our writer's report summary."""
    if rank == 0 and truth is not None:
        from safetensors.torch import save_file
        os.makedirs(saved, exist_ok=True)
        save_file({k: v.contiguous() for k, v in truth.items()}, os.path.join(saved, f"{name}.truth"))
    ours = HuggingFaceStorageWriter(os.path.join(saved, name), mapping, max_shard_size=max_shard_size, timeout=60,
                                    process_group=group)
    dcp.save(sd, storage_writer=ours, process_group=group)
    dcp.save(sd, process_group=group, storage_writer=TorchWriter(os.path.join(saved, f"{name}-torch"), mapping,
                                                                 save_distributed=True, enable_consolidation=True))
    ranks = ours.report["ranks"]
    return {"written_by_all": sum(r["bytes_written"] for r in ranks), "total_bytes": ours.report["total_bytes"],
            "files": ours.report["files"], "written": ranks[rank]["bytes_written"]}


def full_tensors(seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {
        "model.embed_tokens.weight": r(37, 32).to(torch.bfloat16),
        "model.layers.0.a.weight": r(5, 7),
        "model.layers.0.tiny.weight": r(2, 6).to(torch.float16),
        "model.layers.0.b.weight": r(6, 10).to(torch.float16),
        "model.layers.0.fp8.weight": r(9, 16).to(torch.float8_e4m3fn),
        "model.norm.weight": r(37),
        "lm_head.bias": r(11).to(torch.bfloat16),
    }


def dims(saved, rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    full = full_tensors(1)
    place = {"model.layers.0.b.weight": [Shard(1)], "model.norm.weight": [Replicate()]}
    sd = {}
    for k, v in full.items():
        if k == "lm_head.bias":
            sd[k] = v.clone()  # a plain tensor, the same on every rank
        elif v.dtype == torch.float8_e4m3fn:  # distribute_tensor's scatter cannot take fp8: shard its bytes
            local = distribute_tensor(v.view(torch.uint8), mesh, [Shard(0)]).to_local().view(torch.float8_e4m3fn)
            from torch.distributed.tensor import DTensor
            sd[k] = DTensor.from_local(local, mesh, [Shard(0)], shape=v.shape, stride=v.stride())
        else:
            sd[k] = distribute_tensor(v, mesh, place.get(k, [Shard(0)]))
    out = {"split": both(sd, saved, "dims", rank, full, max_shard_size="1KB")}
    mapping = {k: 1 + i % 2 for i, k in enumerate(full)}
    out["mapped"] = both(sd, saved, "dims-mapped", rank, None, mapping=mapping)
    return out


def llama_model(world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=32, intermediate_size=40, vocab_size=37, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    truth = {k: v.detach().clone() for k, v in model.state_dict().items()}
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, truth


def llama(saved, rank, world):
    model, truth = llama_model(world)
    d = os.path.join(saved, "llama")
    if rank == 0:  # the directory already holds a config and an adapter (kept), and a stale single file and
        # a shard of another count (the old model's files: dropped)
        os.makedirs(d, exist_ok=True)
        model.config.save_pretrained(d)
        for name in ("model.safetensors", "model-00003-of-00003.safetensors", "adapter_model.safetensors"):
            with open(os.path.join(d, name), "w") as f:
                f.write("stale" if name.startswith("model") else "adapter")
    dist.barrier()
    mapping = {k: (1 if ".layers.0." in k or "embed" in k else 2) for k in truth}
    return both(model.state_dict(), saved, "llama", rank, truth, mapping=mapping)


def tp_fsdp(saved, rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    class Mlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up_proj = torch.nn.Linear(31, 42, bias=False)
            self.down_proj = torch.nn.Linear(42, 31)

    torch.manual_seed(3)
    mlp = Mlp()
    truth = {f"model.mlp.{k}": v.detach().clone() for k, v in mlp.state_dict().items()}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(mlp, mesh["tp"], {"up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()})
    fully_shard(mlp, mesh=mesh["dp"])
    sd = {f"model.mlp.{k}": v for k, v in mlp.state_dict().items()}
    out = both(sd, saved, "tp_fsdp", rank, truth)
    out["placements"] = {k: str(v.placements) for k, v in sd.items()}
    return out


def errors(saved, rank, world):
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    w = distribute_tensor(torch.arange(70, dtype=torch.float32).reshape(7, 10), mesh, [Shard(0)])
    res = {}
    sd = {"model.w": w, "optimizer.step_blob": io.BytesIO(b"not a tensor")}
    res["bytes_io"] = outcome(lambda: dcp.save(sd, storage_writer=HuggingFaceStorageWriter(
        os.path.join(saved, "err-bytes"), timeout=30)))
    sd = {"model.w": w, "model.v": distribute_tensor(torch.ones(5), mesh, [Shard(0)])}
    res["unmapped"] = outcome(lambda: dcp.save(sd, storage_writer=HuggingFaceStorageWriter(
        os.path.join(saved, "err-unmapped"), {"model.w": 1}, timeout=30)))

    class Failing(DefaultSavePlanner):
        def resolve_data(self, item):
            raise RuntimeError("this rank's planner cannot resolve its data")

    # rank 1 alone with another mapping (regression, fault campaign: rank 0's governed, unseen), then with a
    # file number as text (it raised a bare ValueError on rank 1 alone, outside the save's agreement, and the
    # group failed every later save); then every rank with a float (truncated into file 1, silently)
    two = {"model.w": 1, "model.v": 1}
    res["mapping_differs"] = outcome(lambda: dcp.save(sd, storage_writer=HuggingFaceStorageWriter(
        os.path.join(saved, "err-mapping"), two if rank != 1 else {"model.w": 1, "model.v": 2}, timeout=30)))
    res["mapping_text"] = outcome(lambda: dcp.save(sd, storage_writer=HuggingFaceStorageWriter(
        os.path.join(saved, "err-mapping"), two if rank != 1 else {"model.w": 1, "model.v": "x"}, timeout=30)))
    res["mapping_float"] = outcome(lambda: dcp.save(sd, storage_writer=HuggingFaceStorageWriter(
        os.path.join(saved, "err-mapping"), {"model.w": 1, "model.v": 1.7}, timeout=30)))
    res["one_rank_fails"] = outcome(lambda: dcp.save(
        sd, planner=Failing() if rank == 1 else DefaultSavePlanner(),
        storage_writer=HuggingFaceStorageWriter(os.path.join(saved, "err-one"), timeout=30)))
    # every rank the same whole tensor, each saving alone into one directory (regression, review: the saves
    # raced, one rank's build removed by another's, an IoError on some ranks and a checkpoint on others)
    res["no_collectives"] = outcome(lambda: dcp.save(
        {"model.w": w.full_tensor()}, use_collectives=False,
        storage_writer=HuggingFaceStorageWriter(os.path.join(saved, "err-nocoll"), timeout=30)))
    res["left"] = sorted(n for n in os.listdir(saved) if n.startswith("err-"))
    return res


def kill(saved, rank, world):
    model, _ = llama_model(world)
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=20))
    d = os.path.join(saved, "llama")

    def die(done, total):
        if rank == 1 and done > 0:  # after this rank's first bytes reached the file
            os.kill(os.getpid(), signal.SIGKILL)

    res = {"before": tree_digest(d) if rank == 0 else None}
    res.update(outcome(lambda: dcp.save(model.state_dict(), process_group=group, storage_writer=HuggingFaceStorageWriter(
        d, max_shard_size="20KB", chunk_bytes="4K", progress=die, timeout=20, process_group=group))))
    return res


def main():
    _, root, out_path = sys.argv[1:4]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    saved = f"{out_path}-saved"
    scenarios = [("dims", dims), ("llama", llama), ("errors", errors)]
    if world == 4:
        scenarios[2:2] = [("tp_fsdp", tp_fsdp)]
        scenarios.append(("kill", kill))
    result = {"saved": saved}
    for name, scenario in scenarios:
        result[name] = scenario(saved, rank, world)
        with open(f"{out_path}.{rank}", "w") as f:
            json.dump(result, f)
    if world == 4 and rank == 0:  # it hosts the store: keep it up until every survivor reported
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(_reported(f"{out_path}.{r}") for r in (2, 3)):
            time.sleep(0.1)
    os._exit(0)  # the kill scenario leaves the process group broken: no teardown


if __name__ == "__main__":
    main()
