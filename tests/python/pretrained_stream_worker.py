"""One rank of test_pretrained_stream: `python pretrained_stream_worker.py MODE ROOT OUT` with torchrun's
variables, ROOT holding one checkpoint per model (save_pretrained).

MODE phases: shardcast.from_pretrained of every model; its report's per-rank phases, as the typed report
             and as its dict.
MODE scenarios: several modes in turn, in these processes (ranks.each_scenario).
"""
import datetime
import os
import sys

import torch
import torch.distributed as dist

import ranks
import shardcast


def phases(root):
    out = {}
    for name in sorted(os.listdir(root)):
        model = shardcast.from_pretrained(os.path.join(root, name), dtype=torch.bfloat16, timeout=120)
        report = model.shardcast_report
        out[name] = {"typed": [{"rank": r.rank, "phases": dict(r.phases), "total": r.pretrained_seconds,
                                "load_seconds": r.seconds} for r in report.ranks],
                     "dict": report.to_dict()["ranks"]}
    return out


def main():
    mode, root, out_path = sys.argv[1:4]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    modes = {"phases": phases}
    ranks.each_scenario(mode, root, lambda name, where: modes[name](where), f"{out_path}.{dist.get_rank()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
