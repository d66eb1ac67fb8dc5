"""One rank of test_ranks.py, without torch (it starts in milliseconds): `python scenarios_worker.py MODE ROOT
OUT` with torchrun's variables. Its scenarios: echo (this rank's view, SCENARIO_VAR included), raise_on_1 (rank 1 raises), die_on_1
(rank 1 exits mid-launch), sleep (outlives any test's timeout), imports (whether it was forked by ranks.py's server)."""
import os
import sys
import time

import ranks


def scenario(name, root):
    rank = int(os.environ["RANK"])
    if name == "echo":
        return {"rank": rank, "world": int(os.environ["WORLD_SIZE"]), "root": root, "var": os.environ.get("SCENARIO_VAR")}
    if name == "raise_on_1" and rank == 1:
        raise ValueError("rank 1 fails this one on purpose")
    if name == "die_on_1" and rank == 1:
        print("rank 1 exits on purpose", flush=True)
        os._exit(3)
    if name == "imports":  # whether this rank was forked by ranks.py's server (which imported torch), and
        hub = sys.modules.get("huggingface_hub.constants")  # the hub's home as its import read it
        return {"rank": rank, "forked": hub is not None, "hf_home": hub.HF_HOME if hub else None,
                "hash": hash("shardcast")}  # Python's string-hash seed, fixed when an interpreter starts
    if name == "sleep":
        time.sleep(600)
    return "fine"


def main():
    mode, root, out = sys.argv[1:4]
    ranks.each_scenario(mode, root, scenario, f"{out}.{os.environ['RANK']}")


if __name__ == "__main__":
    main()
