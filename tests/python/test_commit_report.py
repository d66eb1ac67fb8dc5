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
with torch.device("meta"):
    model = Wide()
report = shardcast.load(model, sys.argv[1], target="cpu")
ref = load_file(sys.argv[1] + "/model.safetensors")
assert torch.equal(model.lin.weight, ref["lin.weight"]), "the shard differs from the checkpoint"
threads = report.ranks[0].commit_threads
del model, report  # the shard, freed while a thread let go may still hold it: it must stay mapped for it
print(may_leave_idle(), threads)
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


def run(checkpoint, unprivileged=False):
    """(whether the load's process could lift a thread from SCHED_IDLE, its commit_threads); the load's shard
    checked against the checkpoint there. unprivileged: without CAP_SYS_NICE (setpriv, where root) and with
    an RLIMIT_NICE of 0."""
    command = [sys.executable, "-c", SCRIPT, str(checkpoint)]
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
    may, threads = out.stdout.split()[-2:]
    return may == "True", int(threads)


def test_a_cpu_load_commits_beside_the_stream(checkpoint):
    _, threads = run(checkpoint)
    assert threads > 0, f"commit_threads {threads}"


def test_without_cap_sys_nice_nor_rlimit_nice_the_commit_runs_and_the_shards_are_the_same(checkpoint):
    may, threads = run(checkpoint, unprivileged=True)
    assert not may, "the process could still lift a thread from SCHED_IDLE: the test ran privileged"
    assert threads > 0, "no commit started where its threads cannot be lifted again"
