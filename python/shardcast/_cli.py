"""The `shardcast` console script: execs the C++ command installed inside the package.

`pip install` puts the binary at shardcast/bin/shardcast, next to this file, with a RUNPATH that finds
the torch wheel's libtorch (cmake/Install.cmake), so no LD_LIBRARY_PATH is needed and torch is not
imported here: the command starts as fast as the binary does. In an editable install this file is the
source tree's and the binary is in site-packages; the distribution's file list finds it there. From a
build tree (PYTHONPATH=build/python) it is that build's tools/shardcast. `python -m shardcast` is this
same entry (__main__.py).
"""
from __future__ import annotations

import os
import sys
from typing import List, Optional


def _candidates() -> List[str]:
    here = os.path.dirname(os.path.abspath(__file__))
    found = [os.path.join(here, "bin", "shardcast")]
    build = os.path.dirname(os.path.dirname(here))  # PYTHONPATH=build/python: the same build's command
    if os.path.isfile(os.path.join(build, "CMakeCache.txt")):
        found.append(os.path.join(build, "tools", "shardcast"))
    try:
        from importlib.metadata import PackageNotFoundError, files
        try:
            for f in files("shardcast") or ():
                if f.as_posix().endswith("shardcast/bin/shardcast"):
                    found.append(str(f.locate()))
        except PackageNotFoundError:
            pass
    except ImportError:  # pragma: no cover (Python < 3.8)
        pass
    return found


def binary() -> str:
    """The path of the installed C++ command; raises FileNotFoundError naming where it looked."""
    candidates = _candidates()
    for path in candidates:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise FileNotFoundError("shardcast: the command's binary is not installed (looked in "
                            + ", ".join(candidates) + "); reinstall with `pip install --no-build-isolation .`")


def main(argv: Optional[List[str]] = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        exe = binary()
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        raise SystemExit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(exe, ["shardcast"] + args)  # the binary re-executes itself through /proc/self/exe


if __name__ == "__main__":
    main()
