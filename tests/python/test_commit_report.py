"""The commit beside the stream, as a load's report shows it (`commit_threads`): threads where this process may
lift a thread out of SCHED_IDLE again and where it may not (then let go at the stream's end, each keeping the
shards it commits alive until it ends: allocators/commit_beside.h), and the same shards either way."""
import os
import resource
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

SCRIPT = """
import os, sys, threading, torch, shardcast
from safetensors.torch import load_file
def may_leave_idle():  # whether this process may put a thread of its own back from SCHED_IDLE
    ready, done, tid = threading.Event(), threading.Event(), []
    def wait():
        tid.append(threading.get_native_id())
        ready.set()
        done.wait()
    t = threading.Thread(target=wait)
    t.start()
    ready.wait()
    try:
        os.sched_setscheduler(tid[0], os.SCHED_IDLE, os.sched_param(0))
        os.sched_setscheduler(tid[0], os.SCHED_OTHER, os.sched_param(0))
        return True
    except PermissionError:
        return False
    finally:
        done.set()
        t.join()
class Wide(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(1024, 1024, bias=False)
if sys.argv[2] == "meta":  # shards the load maps itself
    with torch.device("meta"):
        model = Wide()
else:  # the caller's own tensors, which the load adopts
    model = Wide()
report = shardcast.load(model, sys.argv[1], target="cpu")
ref = load_file(sys.argv[1] + "/model.safetensors")
assert torch.equal(model.lin.weight, ref["lin.weight"]), "the shard differs from the checkpoint"
threads, let_go = report.ranks[0].commit_threads, report.ranks[0].commit_threads_let_go
del model, report  # the shard, freed while a thread let go may still hold it: it must stay mapped for it
print(may_leave_idle(), threads, let_go)
"""


class Wide(torch.nn.Module):  # 4 MiB of fp32: pieces for the commit beside (tensors under 1 MiB are not)
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(1024, 1024, bias=False)


@pytest.fixture
def checkpoint(tmp_path):
    torch.manual_seed(0)
    save_file({"lin.weight": Wide().lin.weight.detach().contiguous()}, str(tmp_path / "model.safetensors"))
    return tmp_path


def run(checkpoint, unprivileged=False, into="meta"):
    """(whether the load's process could lift a thread from SCHED_IDLE, its commit_threads, of those how many
    it let go at the stream's end: commit_threads_let_go); the load's shard
    checked against the checkpoint there. unprivileged: without CAP_SYS_NICE (setpriv, where root) and with
    an RLIMIT_NICE of 0. into: "meta" (the load maps the shards) or "cpu" (it adopts the caller's)."""
    command = [sys.executable, "-c", SCRIPT, str(checkpoint), into]
    if unprivileged and os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("no setpriv here to drop CAP_SYS_NICE")
        command = ["setpriv", "--inh-caps=-sys_nice", "--bounding-set=-sys_nice"] + command

    def no_nice():
        resource.setrlimit(resource.RLIMIT_NICE, (0, 0))

    out = subprocess.run(command, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                         timeout=120, preexec_fn=no_nice if unprivileged else None)
    if out.returncode != 0 and "setpriv" in out.stderr:
        pytest.skip(f"setpriv could not drop CAP_SYS_NICE here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    may, threads, let_go = out.stdout.split()[-3:]
    return may == "True", int(threads), int(let_go)


def test_a_cpu_load_commits_beside_the_stream(checkpoint):
    may, threads, let_go = run(checkpoint)
    assert threads > 0, f"commit_threads {threads}"
    if may:  # threads that will be joined may commit the caller's own tensors too
        assert let_go == 0, f"{let_go} of {threads} threads let go where they could be lifted"
        _, into_cpu, into_cpu_let_go = run(checkpoint, into="cpu")
        assert into_cpu > 0 and into_cpu_let_go == 0, (into_cpu, into_cpu_let_go)


def test_without_cap_sys_nice_nor_rlimit_nice_the_commit_runs_on_its_own_shards_only(checkpoint):
    """Threads let go at the stream's end commit only the shards the load mapped itself (their mappings keep
    them alive): never the caller's tensors, which may be freed or swapped under such a thread."""
    may, threads, let_go = run(checkpoint, unprivileged=True)
    if may:
        pytest.skip("the process could still lift a thread from SCHED_IDLE (CAP_SYS_NICE kept another way)")
    assert threads > 0, "no commit started where its threads cannot be lifted again"
    assert let_go == threads, f"{let_go} of {threads} threads let go where none can be lifted"
    assert run(checkpoint, unprivileged=True, into="cpu")[1:] == (0, 0), "threads let go were given the caller's tensors"
