#!/usr/bin/env python3
"""What a rank's imports cost before from_pretrained's stream can start, and after it: each step's seconds,
in the order the call meets them, in N processes started at once (as N ranks of a node start).

    torch                              the caller's, before init_process_group
    transformers.AutoConfig            from_pretrained reads the config with it
    transformers.conversion_mapping    the model type's checkpoint rules, which the stream's plan needs
    --- the stream can start here (where a rank streams beside the build) ---
    modeling_auto                      AutoModelForCausalLM (a transformers user's script imports it)
    the model's modeling module        imported by the build, beside the stream

On the H200 host (2026-11-28) the import phase before the call took 8-10 s a rank at W=4, against ~1 s on
the 2 vCPU VM; this says which step. With --importtime, one more process prints python -X importtime's
slowest modules (cumulative) of the same imports.

    bench/import_times.py [--procs 4] [--model-type qwen3_moe] [--importtime 25]
"""
import argparse
import json
import subprocess
import sys

STEPS = [
    ("torch", "import torch"),
    ("AutoConfig", "from transformers import AutoConfig"),
    ("conversion_mapping", "import transformers.conversion_mapping"),
    ("modeling_auto", "import transformers.models.auto.modeling_auto"),
    ("modeling module", "import transformers.models.{model}.modeling_{model}"),
]


def child(model: str) -> None:
    import time
    times = {}
    for name, statement in STEPS:
        t = time.monotonic()
        exec(statement.format(model=model), {})  # noqa: S102 -- the fixed statements above
        times[name] = time.monotonic() - t
    print(json.dumps(times), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, default=4, help="processes started at once (default 4)")
    ap.add_argument("--model-type", default="qwen3_moe", help="the modeling module's model type")
    ap.add_argument("--importtime", type=int, default=0, help="also print -X importtime's N slowest modules")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.model_type)
    procs = [subprocess.Popen([sys.executable, __file__, "--child", "--model-type", args.model_type],
                              stdout=subprocess.PIPE, text=True) for _ in range(args.procs)]
    rows = []
    for p in procs:
        out = p.communicate(timeout=600)[0].strip()
        if p.returncode != 0 or not out:  # its traceback went to stderr, above
            sys.exit(f"an importing process failed (exit {p.returncode}): --model-type {args.model_type}?")
        rows.append(json.loads(out.splitlines()[-1]))
    print(f"{args.procs} process(es) at once, seconds per step (each process; the stream could start after "
          f"conversion_mapping):")
    print(f"{'step':<22}" + "".join(f"{'p' + str(i):>8}" for i in range(len(rows))))
    for name, _ in STEPS:
        print(f"{name:<22}" + "".join(f"{r[name]:8.2f}" for r in rows))
    print(f"{'before the stream':<22}" + "".join(f"{sum(r[n] for n, _ in STEPS[1:3]):8.2f}" for r in rows))
    if args.importtime:
        code = "; ".join(s.format(model=args.model_type) for _, s in STEPS)
        err = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True,
                             timeout=600).stderr
        lines = [line.split("|") for line in err.splitlines() if line.startswith("import time:") and "|" in line]
        rows = sorted(((int(c), m.rstrip()) for _, c, m in (x for x in lines if x[1].strip().isdigit())),
                      reverse=True)
        print(f"-X importtime, one process: the {args.importtime} slowest modules (cumulative seconds)")
        for us, module in rows[:args.importtime]:
            print(f"{us / 1e6:8.2f}  {module}")


if __name__ == "__main__":
    main()
