"""Running the shardcast command in tests: one place for the retry on a taken port."""
import os
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs" / "models"


def sc(shardcast_bin, *args, env=None):
    # The launcher's free port can be taken by a concurrent test before rank 0 binds it: run again.
    for _ in range(3):
        r = subprocess.run([str(shardcast_bin), *map(str, args)], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, **(env or {})))
        if "EADDRINUSE" not in r.stderr:
            return r
    return r
