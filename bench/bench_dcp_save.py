#!/usr/bin/env python3
"""dcp.save of an FSDP2 model's state dict as a finished Hugging Face checkpoint, the way torchtitan's
last_save_in_hf calls it, at world size W on CPU/Gloo:

  torch        torch.distributed.checkpoint.hf_storage.HuggingFaceStorageWriter(save_distributed=True,
               enable_consolidation=True), its default thread counts (1, 1): every rank writes its pieces into
               files of its own under path/sharded, then rank 0 reads them all back into the whole tensors
  torch-best   the same with thread_count=T and thread_count_consolidation=T (T = the cores, at least 2)
  shardcast    shardcast.dcp.HuggingFaceStorageWriter(path): every rank writes its pieces once, at their
               final offsets in the finished files; no second pass

The model is a dense Llama built from a config (hidden 2048, intermediate 5632, vocab 32000, --layers of
them: 16 is ~1.9 GB in bf16) on meta, fully_shard'ed per layer and at the root, then allocated per rank
(to_empty) and filled with a pattern of its own. All three get the same fqn_to_index_mapping (~500 MB
files), so the files are the same. Timed on every rank from a barrier before dcp.save to a barrier after
it; the slowest rank's time is reported, and GB/s is the checkpoint's bytes over it (decimal). Bytes
written are every file under the output directory afterwards (torch's per-rank files included). Memory:
each rank samples /proc/self/status every 5 ms (RssAnon, RssFile) and reads VmHWM at the end; peaks are
above the rank's baseline just before dcp.save, rank 0's and the node's (the ranks' sum). Correctness next
to every timing: a CRC32 of every tensor's bytes in the output, by key, the same under every method.
Runs are interleaved (torch, torch-best, shardcast, torch, ...), the median of --repeat is reported.

    bench/bench_dcp_save.py [--world-size 4] [--layers 16] [--repeat 3] [--methods torch,torch-best,shardcast]
                            [--dir /tmp/shardcast-bench-dcp-save] [--out bench/results/dcp_save.json]
"""
import argparse
import json
import os
import pathlib
import shutil
import statistics
import sys
import time
import zlib

from _ranks import ROOT, launch
from bench_peers import Sampler, status

METHODS = ("torch", "torch-best", "shardcast")


def config(layers):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=2048, intermediate_size=5632, vocab_size=32000, num_hidden_layers=layers,
                       num_attention_heads=16, num_key_value_heads=16, tie_word_embeddings=False, dtype="bfloat16")


def mapping(layers, per_file=4):
    """The same file layout for every method: embeddings first, per_file layers a file, norm and head last."""
    files = (layers + per_file - 1) // per_file
    out = {"model.embed_tokens.weight": 1, "model.norm.weight": files + 2, "lm_head.weight": files + 2}
    for i in range(layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            out[f"model.layers.{i}.{name}.weight"] = 2 + i // per_file
        for name in ("input_layernorm", "post_attention_layernorm"):
            out[f"model.layers.{i}.{name}.weight"] = 2 + i // per_file
    return out


def worker(method, layers, path, out):
    import datetime
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=20))
    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.device("meta"):
        model = LlamaForCausalLM(config(layers)).to(torch.bfloat16)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            local = p.to_local().view(-1)
            local.copy_((torch.arange(local.numel(), dtype=torch.int32) * (7 + i) + rank * 1000) % 509 - 254)
    state = model.state_dict()
    fqn = mapping(layers)
    if method == "shardcast":
        from shardcast.dcp._hf_writer import HuggingFaceStorageWriter
        writer = HuggingFaceStorageWriter(path, fqn)
    else:
        from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
        threads = max(2, os.cpu_count() or 2) if method == "torch-best" else 1
        writer = HuggingFaceStorageWriter(path, fqn, thread_count=threads, save_distributed=True,
                                          enable_consolidation=True, thread_count_consolidation=threads)
    dist.barrier()
    sampler = Sampler()
    sampler.start()
    t0 = time.monotonic()
    dcp.save(state, storage_writer=writer)
    dist.barrier()
    seconds = time.monotonic() - t0
    sampler.stop = True
    sampler.join()
    end = status()
    result = {"rank": rank, "seconds": seconds,
              "peak_rss_anon": sampler.peak["RssAnon"] - sampler.base["RssAnon"],
              "peak_rss_file": sampler.peak["RssFile"] - sampler.base["RssFile"],
              "base_rss_anon": sampler.base["RssAnon"], "base_rss_file": sampler.base["RssFile"],
              "vm_hwm": end["VmHWM"]}
    pathlib.Path(f"{out}.{rank}").write_text(json.dumps(result))
    dist.destroy_process_group()


def crcs(path):
    """{key: CRC32 of its bytes} of the finished checkpoint (the index's files), and the data bytes."""
    from safetensors import safe_open
    import torch
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    out, total = {}, 0
    for name in files:
        with safe_open(os.path.join(path, name), framework="pt") as st:
            for k in st.keys():
                t = st.get_tensor(k).contiguous().view(-1).view(torch.uint8)
                out[k] = zlib.crc32(t.numpy().tobytes())
                total += t.numel()
    return out, total


def disk_bytes(path):
    return sum(os.path.getsize(os.path.join(b, f)) for b, _, fs in os.walk(path) for f in fs)


def run_one(method, args, n):
    path = os.path.join(args.dir, "ckpt")
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    results = os.path.join(args.dir, f"result-{method}-{n}")
    ranks = launch(pathlib.Path(__file__), [method, args.layers, path, results], args.world_size, results,
                   f"{method} run {n}", timeout_s=3600)
    digest, data = crcs(path)
    run = {"method": method, "seconds": max(r["seconds"] for r in ranks), "data_bytes": data,
           "bytes_written": disk_bytes(path),
           "rank0_peak_rss_anon": ranks[0]["peak_rss_anon"], "rank0_peak_rss_file": ranks[0]["peak_rss_file"],
           "rank0_vm_hwm": ranks[0]["vm_hwm"],
           "node_peak_rss_anon": sum(r["peak_rss_anon"] for r in ranks),
           "node_peak_rss_file": sum(r["peak_rss_file"] for r in ranks),
           "node_vm_hwm": sum(r["vm_hwm"] for r in ranks),
           "crc": zlib.crc32(json.dumps(sorted(digest.items())).encode())}
    shutil.rmtree(args.dir, ignore_errors=True)
    return run


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        method, layers, path, out = sys.argv[2:6]
        return worker(method, int(layers), path, out)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--dir", default="/tmp/shardcast-bench-dcp-save")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "dcp_save.json"))
    args = p.parse_args()
    methods = args.methods.split(",")
    runs = []
    for n in range(args.repeat):
        for m in methods:
            runs.append(run_one(m, args, n))
            r = runs[-1]
            print(f"  {m:11s} run {n}: {r['seconds']:.2f} s", flush=True)
    crc = {r["crc"] for r in runs}
    summaries = []
    for m in methods:
        mine = [r for r in runs if r["method"] == m]
        med = lambda k: statistics.median(r[k] for r in mine)  # noqa: E731
        s = {"method": m, "runs": len(mine), "seconds": med("seconds"), "seconds_all": [r["seconds"] for r in mine],
             "data_bytes": mine[0]["data_bytes"], "gb_per_s": mine[0]["data_bytes"] / med("seconds") / 1e9,
             **{k: med(k) for k in ("bytes_written", "rank0_peak_rss_anon", "rank0_peak_rss_file", "rank0_vm_hwm",
                                   "node_peak_rss_anon", "node_peak_rss_file", "node_vm_hwm")}}
        summaries.append(s)
    gb = lambda b: f"{b / 1e9:.2f}"  # noqa: E731
    print(f"dcp.save, dense Llama {args.layers} layers ({gb(summaries[0]['data_bytes'])} GB bf16), W={args.world_size}, "
          f"CPU/Gloo, median of {args.repeat}; tensors CRC-identical across every run: {len(crc) == 1}")
    print(f"{'method':11s} {'s':>7s} {'GB/s':>6s} {'written GB':>10s} {'r0 anon':>8s} {'r0 file':>8s} {'r0 HWM':>7s} "
          f"{'node anon':>9s} {'node file':>9s} {'node HWM':>8s}   (GB; peaks above baseline)")
    for s in summaries:
        print(f"{s['method']:11s} {s['seconds']:7.2f} {s['gb_per_s']:6.3f} {gb(s['bytes_written']):>10s} "
              f"{gb(s['rank0_peak_rss_anon']):>8s} {gb(s['rank0_peak_rss_file']):>8s} {gb(s['rank0_vm_hwm']):>7s} "
              f"{gb(s['node_peak_rss_anon']):>9s} {gb(s['node_peak_rss_file']):>9s} {gb(s['node_vm_hwm']):>8s}")
    out = {"world_size": args.world_size, "layers": args.layers, "repeat": args.repeat, "crc_identical": len(crc) == 1,
           "cores": os.cpu_count(), "summaries": summaries, "runs": runs}
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(out, indent=2))
    if len(crc) != 1:
        raise SystemExit("the methods wrote different tensors")


if __name__ == "__main__":
    main()
