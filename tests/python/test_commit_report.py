"""The commit beside the stream, as a load's report shows it (`commit_threads`): threads where this process may
lift a thread out of SCHED_IDLE again, none where it may not (allocators/commit_beside.h), and the same shards
either way."""
import os
import resource
import shutil
import subprocess
import sys
import threading

import pytest
import torch
from safetensors.torch import save_file

import shardcast

SCRIPT = """
import sys, torch, shardcast
from safetensors.torch import load_file
class Wide(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(1024, 1024, bias=False)
with torch.device("meta"):
    model = Wide()
report = shardcast.load(model, sys.argv[1], target="cpu")
ref = load_file(sys.argv[1] + "/model.safetensors")
assert torch.equal(model.lin.weight, ref["lin.weight"]), "the shard differs from the checkpoint"
print(report.ranks[0].commit_threads)
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


def may_leave_idle():
    """Whether this process may put a thread of its own back from SCHED_IDLE, tried on a thread made for it."""
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


def test_a_cpu_load_commits_beside_the_stream_where_it_may_lift_the_threads(checkpoint):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(checkpoint)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    threads = int(out.stdout.split()[-1])
    assert (threads > 0) == may_leave_idle(), f"commit_threads {threads}"


def test_without_cap_sys_nice_nor_rlimit_nice_no_commit_starts_and_the_shards_are_the_same(checkpoint):
    command = [sys.executable, "-c", SCRIPT, str(checkpoint)]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("no setpriv here to drop CAP_SYS_NICE")
        command = ["setpriv", "--inh-caps=-sys_nice", "--bounding-set=-sys_nice"] + command

    def no_nice():
        resource.setrlimit(resource.RLIMIT_NICE, (0, 0))

    out = subprocess.run(command, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                         timeout=120, preexec_fn=no_nice)
    if out.returncode != 0 and "setpriv" in out.stderr:
        pytest.skip(f"setpriv could not drop CAP_SYS_NICE here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) == 0, "a commit started where its threads could not be lifted again"
