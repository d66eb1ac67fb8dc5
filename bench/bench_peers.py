#!/usr/bin/env python3
"""The whole set-up against the peers users already have: one transformers checkpoint (Qwen3-MoE, bf16,
by save_pretrained; 12 layers ~2 GB, 40 ~6 GB) made an FSDP2 model at world size W on CPU/Gloo by

  transformers               from_pretrained(distributed_config=DistributedConfig(fsdp_size=W)), native
  shardcast-from-pretrained  shardcast.from_pretrained(fsdp_size=W), its defaults
  shardcast-from-pretrained-prefetch      the same with prefetch=True (read-ahead while it builds, which
                                          its default leaves off with fewer than 2 cores per rank)
  shardcast-from-pretrained-default       shardcast.from_pretrained() with its own default layout (fully_shard
                                          over all ranks, the same shards), whose pieces it predicts from
                                          the header: it streams them while it builds the model where the
                                          node has two cores a rank, else loads after the build
  shardcast-from-pretrained-beside        the same layout with stream_beside_build=True: streaming beside
                                          the build whatever the cores
  shardcast-from-pretrained-after         the same layout with stream_beside_build=False: build, lay out,
                                          then load
  shardcast-each-rank        meta model -> shardcast.prepare -> fully_shard -> shardcast.load(source="each-rank")
  shardcast-rank0            the same with source="rank0"
  accelerate                 meta model -> fully_shard; rank 0's from_pretrained (cpu_ram_efficient_loading's
                             flow) -> accelerate.utils.fsdp_utils.fsdp2_load_full_state_dict
  dcp                        the same, then set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)

each in its own launch of W processes. With --model gpt-oss-mxfp4, a gpt-oss checkpoint whose experts are
MXFP4 (gpt-oss-20b's widths and 32 experts, random blocks and scales in its range), made a bf16 FSDP2 model by
transformers (Mxfp4Config(dequantize=True), what it does on CPU anyway) and by shardcast.from_pretrained
(dequantized in the stream), and kept in MXFP4 by shardcast.from_pretrained(keep_quantized=True)
(shardcast-kept-mxfp4: a different model, so its CRCs are compared only across its own runs). With --layout ep or tp, the same checkpoint on transformers' EP x FSDP
(DistributedConfig(ep_size=2, fsdp_size=W): experts on their own mesh) or TP x FSDP (tp_size=2,
fsdp_size=W/2: its tp_plan) layout, through the two calls that take one: transformers' from_pretrained and
shardcast.from_pretrained(distributed_config=...), with and without prefetch. Each rank's pieces must be
the same under both (the CRCs below). Runs are timed on every rank from just after init_process_group (torch
imported, transformers and the method's library not) to the model ready on every rank (a barrier):

  import  what the method's own script imports: transformers' AutoModelForCausalLM (modeling_auto) where
          it names it (transformers, and the flows that build the meta model themselves), transformers'
          DistributedConfig where it passes one, and the method's library. shardcast.from_pretrained's script
          imports shardcast alone: the call imports transformers' modeling code itself, once its stream runs
          (its own report's import phase)
  build   the config and the meta model, transformers importing the model's modeling module included
          (shardcast: and prepare)
  shard   fully_shard of each decoder layer, then of the root
  load    the rest: the weights in place (accelerate, dcp: rank 0's from_pretrained too), the barrier

The two from_pretrained calls build, shard and load in one call: their build and shard are folded into
load. The total and each phase are the slowest rank's (the phases may add up to more than the total).
from_pretrained's own report splits its call per rank (import, config, build, layout, stream, wait:
shardcast/_phases.py); a second table prints that split for each rank of the median run.
Each rank's CPU time over the run (its process, every thread, the 5 ms memory sampler's included) is added
up over the node ("node cpu"); over the total it says how many cores the run kept busy: near the machine's
core count, the run is bound by CPU, and no overlap of its phases can shorten it. After the timed part each
rank times one full `gc.collect()` ("gc after", not in the total): the collection the objects the set-up
made cost the caller later.
Each rank samples its own /proc/self/status every 5 ms from just after init_process_group; peaks are
above that baseline. Correctness next to every timing: each rank's CRC32 over its local shards in
sorted parameter-name order, and over the names, must be the same under every method and run.
Before each method the checkpoint is read into the page cache, or with --cold evicted from it
(posix_fadvise DONTNEED); the bytes still resident (mincore) are reported.

    bench/bench_peers.py [--world-size 4] [--layers 12] [--cold] [--layout fsdp|ep|tp] [--methods a,b,...]
                         [--model qwen3-moe|gpt-oss-mxfp4]
                         [--repeat 1] [--out bench/results/peers.json, peers-ep.json, peers-tp.json]
"""
import argparse
import gc
import json
import pathlib
import sys
import threading
import time
import zlib

from _checkpoints import set_page_cache, write_checkpoint, write_gpt_oss_mxfp4
from _peers_report import PHASES, print_phases, print_table, summary
from _ranks import ROOT, launch


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


class Clock:
    """Seconds per phase on this rank: lap(phase) charges the time since the previous lap to phase."""

    def __init__(self):
        self.start = self.last = time.monotonic()
        self.phases = dict.fromkeys(PHASES, 0.0)

    def lap(self, phase):
        now = time.monotonic()
        self.phases[phase] += now - self.last
        self.last = now


def meta_model(ckpt):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(ckpt)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def shard(model, world, device="cpu"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(device, (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


# --layout: the DistributedConfig keywords for a world of W (fsdp: FSDP2 over the whole world).
LAYOUTS = {
    "fsdp": lambda world: {"fsdp_size": world},
    "ep": lambda world: {"ep_size": 2, "fsdp_size": world},
    "tp": lambda world: {"tp_size": 2, "fsdp_size": world // 2},
}


def run_transformers(ckpt, world, clock, layout):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig
    kwargs = {}
    if "mxfp4" in pathlib.Path(ckpt).name:  # what transformers does on CPU anyway, without its warning
        from transformers import Mxfp4Config
        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16,
                                                distributed_config=DistributedConfig(**LAYOUTS[layout](world)), **kwargs)


def run_shardcast_from_pretrained(prefetch=None, keep_quantized=False):
    def run(ckpt, world, clock, layout):
        import torch
        from transformers.distributed import DistributedConfig
        import shardcast
        return shardcast.from_pretrained(ckpt, distributed_config=DistributedConfig(**LAYOUTS[layout](world)),
                                         dtype=torch.bfloat16, prefetch=prefetch, keep_quantized=keep_quantized)
    return run


def run_shardcast_default_layout(beside=None):
    """from_pretrained's own default layout (fully_shard of each decoder layer, then the root, over all ranks):
    the one whose pieces it predicts from the header, so it may stream while it builds (beside: the keyword
    stream_beside_build; None leaves it to from_pretrained's default)."""
    def run(ckpt, world, clock, layout):
        import torch
        import shardcast
        return shardcast.from_pretrained(ckpt, dtype=torch.bfloat16, stream_beside_build=beside)
    return run


def run_shardcast(source):
    def run(ckpt, world, clock, layout):
        import shardcast
        model = meta_model(ckpt)
        shardcast.prepare(model, config=model.config)
        clock.lap("build")
        shard(model, world)
        clock.lap("shard")
        shardcast.load(model, ckpt, source=source)
        return model
    return run


def run_from_rank0(load_full_state_dict):
    """accelerate's and DCP's flow: every rank shards a meta model; rank 0 reads the whole checkpoint."""
    def run(ckpt, world, clock, layout):
        import torch
        from transformers import AutoModelForCausalLM
        model = meta_model(ckpt)
        clock.lap("build")
        shard(model, world)
        clock.lap("shard")
        rank0 = torch.distributed.get_rank() == 0
        full_sd = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).state_dict() if rank0 else {}
        load_full_state_dict(model, full_sd, rank0)
        return model
    return run


def accelerate_load(model, full_sd, rank0):
    from types import SimpleNamespace
    from accelerate.utils.fsdp_utils import fsdp2_load_full_state_dict
    fsdp2_load_full_state_dict(SimpleNamespace(is_main_process=rank0), model, full_sd)


def dcp_load(model, full_sd, rank0):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    model.to_empty(device="cpu")
    set_model_state_dict(model, full_sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


# build and shard inside one call, timed as load; the only methods that take a layout other than fsdp
FOLDED = {"transformers", "shardcast-from-pretrained", "shardcast-from-pretrained-prefetch", "shardcast-kept-mxfp4",
          "shardcast-from-pretrained-default", "shardcast-from-pretrained-beside",
          "shardcast-from-pretrained-after"}
# folded, but with from_pretrained's own FSDP layout: --layout fsdp only
OWN_LAYOUT = {"shardcast-from-pretrained-default", "shardcast-from-pretrained-beside",
              "shardcast-from-pretrained-after"}
AUTO = "transformers.models.auto.modeling_auto"  # AutoModelForCausalLM
# name -> (what its script imports, the import phase, how it builds, shards and loads)
METHODS = {
    "transformers": ([AUTO, "transformers.distributed"], run_transformers),
    "shardcast-from-pretrained": (["transformers.distributed", "shardcast"], run_shardcast_from_pretrained()),
    "shardcast-from-pretrained-prefetch": (["transformers.distributed", "shardcast"],
                                           run_shardcast_from_pretrained(prefetch=True)),
    "shardcast-from-pretrained-default": (["shardcast"], run_shardcast_default_layout()),
    "shardcast-from-pretrained-beside": (["shardcast"],
                                         run_shardcast_default_layout(beside=True)),
    "shardcast-from-pretrained-after": (["shardcast"],
                                        run_shardcast_default_layout(beside=False)),
    "shardcast-kept-mxfp4": (["transformers.distributed", "shardcast"],
                             run_shardcast_from_pretrained(keep_quantized=True)),
    "shardcast-each-rank": ([AUTO, "shardcast"], run_shardcast("each-rank")),
    "shardcast-rank0": ([AUTO, "shardcast"], run_shardcast("rank0")),
    "accelerate": ([AUTO, "accelerate.utils.fsdp_utils"], run_from_rank0(accelerate_load)),
    "dcp": ([AUTO, "torch.distributed.checkpoint.state_dict"], run_from_rank0(dcp_load)),
}


def local_crcs(model):
    """CRC32 over this rank's local piece of every parameter in sorted name order, and over the names."""
    import torch
    params = sorted(model.named_parameters())
    crc = 0
    for _, p in params:
        local = p.to_local() if hasattr(p, "to_local") else p
        crc = zlib.crc32(local.detach().contiguous().view(torch.uint8).numpy().tobytes(), crc)
    return {"crc": crc, "names_crc": zlib.crc32(" ".join(n for n, _ in params).encode())}


def worker(method, ckpt, out, layout):
    import datetime
    import importlib
    import torch.distributed as dist
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=20))
    sampler = Sampler()
    sampler.start()
    dist.barrier()
    clock = Clock()
    cpu = time.process_time()  # this process's CPU time, every thread's
    modules, run = METHODS[method]
    for name in modules:
        importlib.import_module(name)
    clock.lap("import")
    model = run(ckpt, dist.get_world_size(), clock, layout)
    dist.barrier()
    clock.lap("load")
    sampler.stop = True
    sampler.join()
    cpu = time.process_time() - cpu
    collect = time.monotonic()  # one full collection after the timed part: what the objects the set-up made
    gc.collect()                # cost the caller's collector later (from_pretrained pauses it during its call)
    collect = time.monotonic() - collect
    result = {"rank": dist.get_rank(), "seconds": clock.last - clock.start, "cpu_seconds": cpu,
              "gc_after_seconds": collect, "phases": clock.phases,
              **local_crcs(model),
              "peak_rss_anon": sampler.peak["RssAnon"] - sampler.base["RssAnon"],
              "peak_rss_file": sampler.peak["RssFile"] - sampler.base["RssFile"],
              "base_rss_anon": sampler.base["RssAnon"], "base_rss_file": sampler.base["RssFile"]}
    if hasattr(model, "shardcast_report"):
        report = model.shardcast_report
        result["source"] = report.get("source")
        mine = next((r for r in getattr(report, "ranks", ()) if r.rank == dist.get_rank()), None)
        if mine is not None and mine.phases:  # from_pretrained's own split of its set-up
            result["pretrained_phases"] = {**mine.phases, "total": mine.pretrained_seconds,
                                           "cpu": mine.pretrained_cpu_seconds}
    pathlib.Path(f"{out}.{dist.get_rank()}").write_text(json.dumps(result))
    dist.destroy_process_group()


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(*sys.argv[2:6])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--cold", action="store_true", help="evict the checkpoint from the page cache before each method")
    ap.add_argument("--layout", default="fsdp", choices=list(LAYOUTS),
                    help="fsdp (FSDP2 over the world), ep (EP 2 x FSDP W), tp (TP 2 x FSDP W/2)")
    ap.add_argument("--methods", help=f"comma-separated, of: {', '.join(METHODS)} (default: every one that takes "
                                      "the layout)")
    ap.add_argument("--model", default="qwen3-moe", choices=["qwen3-moe", "gpt-oss-mxfp4"],
                    help="qwen3-moe (bf16, save_pretrained) or gpt-oss-mxfp4 (MXFP4 experts; default --layers 2 "
                         "then, and the methods transformers, shardcast-from-pretrained, shardcast-kept-mxfp4)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each method, interleaved; the table: the median")
    ap.add_argument("--work", default=str(ROOT / "out/bench-peers"))
    ap.add_argument("--out", help="default bench/results/peers.json (fsdp), peers-LAYOUT.json (ep, tp)")
    args = ap.parse_args()
    mxfp4 = args.model == "gpt-oss-mxfp4"
    takes = [m for m in METHODS if (args.layout == "fsdp" or (m in FOLDED and m not in OWN_LAYOUT))
             and (m != "shardcast-kept-mxfp4" or mxfp4)]
    if mxfp4:
        takes = [m for m in takes if m in ("transformers", "shardcast-from-pretrained", "shardcast-kept-mxfp4")]
        if "--layers" not in sys.argv:
            args.layers = 2
    methods = args.methods.split(",") if args.methods else takes
    if unknown := [m for m in methods if m not in METHODS]:
        ap.error(f"unknown method(s) {', '.join(unknown)}; known: {', '.join(METHODS)}")
    if cannot := [m for m in methods if m not in takes]:
        ap.error(f"{', '.join(cannot)} build FSDP2 alone (fully_shard), not --layout {args.layout}; these take it: "
                 f"{', '.join(takes)}")
    args.out = args.out or str(ROOT / "bench/results" / ("peers-mxfp4.json" if mxfp4 else "peers.json"
                                                         if args.layout == "fsdp" else f"peers-{args.layout}.json"))
    work = pathlib.Path(args.work)
    ckpt = work / f"{args.model}-{args.layers}L"
    if not ckpt.is_dir():
        (write_gpt_oss_mxfp4 if mxfp4 else write_checkpoint)(ckpt, args.layers)
    files = sorted(ckpt.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    runs, resident = {m: [] for m in methods}, []
    for _ in range(args.repeat):  # interleaved, so drift on a shared machine hits every method alike
        for method in methods:
            resident.append(set_page_cache(files, args.cold))
            runs[method].append(launch(__file__, [method, ckpt, work / method, args.layout], args.world_size, work / method,
                                       method, timeout_s=3600, env={"HF_HUB_DISABLE_PROGRESS_BARS": "1"}))
        # each round's totals so far: a run cut short (a device call's deadline) leaves them
        pathlib.Path(f"{args.out}.partial.json").write_text(json.dumps(
            {m: [max(r["seconds"] for r in ranks) for ranks in rs] for m, rs in runs.items()}) + "\n")
    crcs = {m: [[(r["crc"], r["names_crc"]) for r in ranks] for ranks in rs] for m, rs in runs.items()}
    # The kept-quantized model holds other tensors than the bf16 ones: its runs agree among themselves.
    groups = {m: "kept" if m == "shardcast-kept-mxfp4" else "bf16" for m in crcs}
    same = all(len({tuple(run) for m, per_run in crcs.items() if groups[m] == g for run in per_run}) == 1
               for g in set(groups.values()))
    by_time = {m: sorted(rs, key=lambda ranks: max(r["seconds"] for r in ranks)) for m, rs in runs.items()}
    results = {m: rs[len(rs) // 2] for m, rs in by_time.items()}
    summaries = {m: summary(ranks, folded=m in FOLDED) for m, ranks in results.items()}
    print_table(summaries, size, args, resident, LAYOUTS[args.layout](args.world_size))
    print_phases(results)
    print(f"every rank's local shards identical across methods and runs: {same}")
    pathlib.Path(args.out).write_text(json.dumps(
        {"checkpoint_bytes": size, "layers": args.layers, "world_size": args.world_size, "repeat": args.repeat,
         "model": args.model, "layout": args.layout, "distributed_config": LAYOUTS[args.layout](args.world_size),
         "page_cache": "cold" if args.cold else "warm", "resident_bytes_before": resident, "identical": same,
         "summary": summaries, "all_seconds": {m: [max(r["seconds"] for r in ranks) for ranks in rs]
                                               for m, rs in runs.items()},
         "results": results}, indent=2) + "\n")
    pathlib.Path(f"{args.out}.partial.json").unlink(missing_ok=True)
    if not same:
        raise SystemExit(f"shards differ between methods or runs (per run, per rank: crc, names_crc): {crcs}")


if __name__ == "__main__":
    sys.exit(main())
