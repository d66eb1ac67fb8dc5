"""A fork server for the tests' ranks (ranks.py starts one per pytest process): it imports torch, its
distributed packages and transformers once, then forks a rank for each request, so a launch of W ranks no
longer pays W imports of several seconds of CPU each (on CI's two cores, most of a launch's start-up).

Each rank is still its own real process over c10d Gloo, killed and frozen by its pid as before. A forked
rank differs from a fresh interpreter only in what was imported before its variables were set, so ranks.py
forks only where the rank's environment differs from this server's in variables none of these imports
reads (the launcher's, shardcast's, the tests' own); any other launch starts fresh interpreters.

`python zygote.py FD`. Protocol, one JSON object a line. In (stdin): {"id", "script", "argv", "env", "cwd",
"log"}. Out (fd FD):
{"ready": true} once imported, then {"id", "pid"} for each request, {"pid", "code"} when a rank ends
(code as Popen's returncode: negative for a signal). stdin's end (the test process gone) kills every rank
still running, then the server."""
import json
import os
import select
import signal
import sys


def preload():
    import numpy  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401


def rank(request, replies):
    """In the forked child: becomes `python script argv...` with its environment, output to its log.
    Never returns: the script's end (or its SystemExit) ends the interpreter as it would a fresh one."""
    os.close(replies)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    script = request["script"]
    sys.argv = [script, *request["argv"]]
    sys.path[0] = os.path.dirname(script)
    import runpy
    runpy.run_path(script, run_name="__main__")
    sys.exit(0)


def main():
    replies = int(sys.argv[1])
    preload()

    def reply(obj):
        os.write(replies, (json.dumps(obj) + "\n").encode())

    reply({"ready": True})
    live, pending = set(), b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.05)
        if readable:
            chunk = os.read(0, 1 << 16)
            if not chunk:  # the test process is gone: so are its ranks
                for pid in live:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                os._exit(0)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    rank(request, replies)
                live.add(pid)
                reply({"id": request["id"], "pid": pid})
        while live:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            live.discard(pid)
            reply({"pid": pid, "code": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    main()
