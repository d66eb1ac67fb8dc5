"""A fork server for the tests' ranks (forked.py starts them): it imports torch, its distributed packages and
transformers once, then forks a rank for each request, which becomes `python script argv...` with the
request's environment. What a forked rank could see differently from a fresh interpreter, and how forked.py
keeps each apart, is said there. ZYGOTE_PRELOAD=hub (test_ranks.py) imports huggingface_hub's constants alone.

`python zygote.py FD`. Protocol, one JSON object a line. In (stdin): {"id", "script", "argv", "env", "cwd",
"log"} to start a rank, {"kill": id} to SIGKILL one not yet reaped. Out (fd FD): {"ready": true} once
imported, then {"id", "pid"} for each rank started and {"id", "code"} when it ends (code as Popen's
returncode: negative for a signal). stdin's end (the test process gone), or this server's own, kills every
rank still running; a rank whose server dies is killed by the kernel (PR_SET_PDEATHSIG)."""
import ctypes
import json
import os
import select
import signal
import sys

PR_SET_PDEATHSIG = 1


def preload():
    if os.environ.get("ZYGOTE_PRELOAD") == "hub":  # test_ranks.py's light servers: the hub's constants alone
        import huggingface_hub.constants  # noqa: F401
        return
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
    server = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != server:  # the server died before the call: nothing would kill this rank
        os._exit(1)
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
    live, pending = {}, b""  # request id -> pid, until reaped
    try:
        while True:
            readable, _, _ = select.select([0], [], [], 0.05)
            if readable:
                chunk = os.read(0, 1 << 16)
                if not chunk:  # the test process is gone: so are its ranks (finally)
                    return
                pending += chunk
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    request = json.loads(line)
                    if "kill" in request:
                        if request["kill"] in live:  # not reaped: its pid is still its own
                            os.kill(live[request["kill"]], signal.SIGKILL)
                        continue
                    sys.stdout.flush()
                    sys.stderr.flush()
                    pid = os.fork()
                    if pid == 0:
                        rank(request, replies)
                    live[request["id"]] = pid
                    reply({"id": request["id"], "pid": pid})
            while live:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                rid = next((r for r, p in live.items() if p == pid), None)
                if rid is not None:
                    del live[rid]
                    reply({"id": rid, "code": os.waitstatus_to_exitcode(status)})
    finally:
        if os.getpid() == server_pid:  # not in a rank, whose own exit passes through here too
            for pid in live.values():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


server_pid = os.getpid()


if __name__ == "__main__":
    main()
