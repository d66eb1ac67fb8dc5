#!/usr/bin/env python3
"""The real peers, side by side: the same transformers checkpoint (Qwen3-MoE, ~2 GB bf16, written by
save_pretrained) loaded into FSDP2 shards at world size 4 on CPU/Gloo by

  shardcast   meta model -> shardcast.prepare -> fully_shard -> shardcast.load
  accelerate  rank 0 from_pretrained (cpu_ram_efficient_loading's flow), meta model elsewhere ->
              fully_shard -> accelerate.utils.fsdp_utils.fsdp2_load_full_state_dict (installed package)
  dcp         the same, then torch.distributed.checkpoint.state_dict.set_model_state_dict with
              StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)

Each rank samples its own /proc/self/status every 5 ms from just before the load starts; wall time
is the slowest rank's. Correctness next to every timing: each rank's CRC32 over all its local shards
must be the same under all three methods.

    bench/bench_peers.py [--world-size 4] [--layers 12] [--out bench/results/peers.json]
"""
import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys
import threading
import time
import zlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("RssAnon", "RssFile", "VmHWM"):
                out[k] = int(v.split()[0]) * 1024
    return out


class Sampler(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.base, self.peak, self.stop = status(), status(), False

    def run(self):
        while not self.stop:
            s = status()
            for k in self.peak:
                self.peak[k] = max(self.peak[k], s[k])
            time.sleep(0.005)


def worker(method, ckpt, out):
    import datetime
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=20))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    config = AutoConfig.from_pretrained(ckpt)
    dist.barrier()
    sampler = Sampler()
    sampler.start()
    t0 = time.monotonic()
    if method == "shardcast":
        import shardcast
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        shardcast.prepare(model, config=config)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        shardcast.load(model, ckpt)
    else:
        full_sd = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).state_dict() if rank == 0 else {}
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if method == "accelerate":
            from types import SimpleNamespace
            from accelerate.utils.fsdp_utils import fsdp2_load_full_state_dict
            fsdp2_load_full_state_dict(SimpleNamespace(is_main_process=rank == 0), model, full_sd)
        else:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
            model.to_empty(device="cpu")
            set_model_state_dict(model, full_sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        del full_sd
    dist.barrier()
    seconds = time.monotonic() - t0
    sampler.stop = True
    sampler.join()
    crc = 0
    for name, p in sorted(model.named_parameters()):
        local = p.to_local() if hasattr(p, "to_local") else p
        crc = zlib.crc32(local.detach().contiguous().view(torch.int16).numpy().tobytes(), crc)
    result = {"rank": rank, "seconds": seconds, "crc": crc,
              "peak_rss_anon": sampler.peak["RssAnon"] - sampler.base["RssAnon"],
              "peak_rss_file": sampler.peak["RssFile"] - sampler.base["RssFile"]}
    pathlib.Path(f"{out}.{rank}").write_text(json.dumps(result))
    dist.destroy_process_group()


def write_checkpoint(path, layers):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig
    cfg = Qwen3MoeConfig(hidden_size=1024, intermediate_size=2816, moe_intermediate_size=768, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=32,
                         num_experts_per_tok=4, vocab_size=32000, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path, max_shard_size="500MB")


def launch(method, ckpt, world, out):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
               PYTHONPATH=str(ROOT / "build/python"), TORCH_CPP_LOG_LEVEL="ERROR", PYTHONWARNINGS="ignore",
               OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", method, str(ckpt), str(out)],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(world)]
    for p in procs:
        if p.wait(timeout=3600) != 0:
            raise SystemExit(f"{method}: a rank failed")
    return [json.loads(pathlib.Path(f"{out}.{r}").read_text()) for r in range(world)]


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(*sys.argv[2:5])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--work", default=str(ROOT / "out/bench-peers"))
    ap.add_argument("--out", default=str(ROOT / "bench/results/peers.json"))
    args = ap.parse_args()
    work = pathlib.Path(args.work)
    ckpt = work / f"qwen3-moe-{args.layers}L"
    if not (ckpt / "model.safetensors.index.json").exists():
        write_checkpoint(ckpt, args.layers)
    size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    results = {}
    for method in ["shardcast", "accelerate", "dcp"]:
        for f in ckpt.glob("*.safetensors"):  # same warm page cache for everyone
            f.read_bytes()
        results[method] = launch(method, ckpt, args.world_size, work / method)
    crcs = {m: [r["crc"] for r in rs] for m, rs in results.items()}
    same = len({tuple(v) for v in crcs.values()}) == 1
    print(f"checkpoint {size / 1e9:.2f} GB, world size {args.world_size}, shards identical across methods: {same}")
    print(f"{'method':<11} {'seconds':>8} {'rank0 anon':>11} {'rank0 file':>11} {'other anon':>11} {'node anon':>10} {'node file':>10}")
    for m, rs in results.items():
        print(f"{m:<11} {max(r['seconds'] for r in rs):8.2f} {rs[0]['peak_rss_anon'] / 1e9:9.2f}GB "
              f"{rs[0]['peak_rss_file'] / 1e9:9.2f}GB {max(r['peak_rss_anon'] for r in rs[1:]) / 1e9:9.2f}GB "
              f"{sum(r['peak_rss_anon'] for r in rs) / 1e9:8.2f}GB {sum(r['peak_rss_file'] for r in rs) / 1e9:8.2f}GB")
    pathlib.Path(args.out).write_text(json.dumps({"checkpoint_bytes": size, "world_size": args.world_size,
                                                  "identical": same, "results": results}, indent=2) + "\n")
    if not same:
        raise SystemExit(f"shards differ between methods: {crcs}")


if __name__ == "__main__":
    sys.exit(main())
