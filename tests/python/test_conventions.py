"""The rest of issue 33's conventional API: exceptions mapped where they arise (a buffer_init that raises
is a ConfigError, a store timeout a CommTimeout), the wrappers' name infixes stripped as DCP strips them,
no teardown ritual before destroy_process_group, progress on by default on a terminal, and typed
reports that still are the dicts of earlier releases. One process where one will do; the ranks run
once per world size (conventions_worker.py)."""
import datetime
import json
import os
import pathlib
import sys
import time

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

import ranks
import shardcast
from shardcast._exchange import computed_on_rank0
from shardcast._group import _store_host
from shardcast._load import _problem, _progress
from shardcast._names import fqn


@pytest.fixture
def checkpoint(tmp_path):
    torch.manual_seed(0)
    save_file({"weight": torch.randn(3, 4), "bias": torch.randn(3)}, str(tmp_path / "model.safetensors"))
    return tmp_path


def _linear_with_table():
    """A Linear on meta with a non-persistent buffer no built-in rule knows ('table')."""
    with torch.device("meta"):
        m = torch.nn.Linear(4, 3)
        m.register_buffer("table", torch.empty(2, 2), persistent=False)
    return m


def _causes(e):
    chain = []
    while e.__cause__ is not None:
        e = e.__cause__
        chain.append(e)
    return chain


def _boom(name, meta):
    raise ValueError("no table today")


# ---- exceptions mapped where they arise ---------------------------------------------------------------

def test_a_buffer_init_that_raises_is_a_config_error_naming_the_buffer_with_the_cause_chained(checkpoint):
    with pytest.raises(shardcast.ConfigError) as info:
        shardcast.load(_linear_with_table(), checkpoint, buffer_init={"tab*": _boom}, progress=False)
    message = str(info.value)
    assert "'table'" in message and "buffer_init" in message and "ValueError: no table today" in message, message
    assert "cannot allocate" not in message and not isinstance(info.value, shardcast.IoError)
    assert isinstance(_causes(info.value)[-1], ValueError)  # the agreed verdict <- this rank's ConfigError <- it
    with pytest.raises(shardcast.ConfigError, match="buffer_init for non-persistent buffer 'table' raised") as info:
        shardcast.prepare(_linear_with_table(), config={}, buffer_init={"table": _boom})
    assert isinstance(info.value.__cause__, ValueError)


def test_a_buffer_init_returning_no_tensor_is_a_config_error(checkpoint):
    with pytest.raises(shardcast.ConfigError, match="'table' returned NoneType"):
        shardcast.load(_linear_with_table(), checkpoint, buffer_init={"table": lambda n, m: None}, progress=False)


def test_a_store_timeout_is_a_comm_timeout_naming_the_store_host():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=5))
    ch = (store, "group", _store_host(store), {})  # as channel() makes it: with the load's state
    t0 = time.monotonic()
    with pytest.raises(shardcast.CommTimeout) as info:  # rank 1 of 2, and rank 0 never computes
        computed_on_rank0(ch, 1, 2, lambda: {}, 0.5)
    assert time.monotonic() - t0 < 5
    message = str(info.value)
    assert f"127.0.0.1:{store.port}" in message and "within 0.5 s" in message, message
    assert isinstance(info.value.__cause__, dist.DistStoreError)


def test_timeouts_from_elsewhere_are_carried_as_comm_timeouts_not_internal_errors():
    assert _problem(TimeoutError("late"))[0] == "CommTimeout"
    assert _problem(dist.DistStoreError("wait timeout after 300ms"))[0] == "CommTimeout"
    assert _problem(dist.DistNetworkError("connection reset"))[0] == "CommError"
    assert _problem(KeyError("x"))[0] == "InternalError"
    assert _problem(shardcast.IoError("disk"))[0] == "IoError"


# ---- names as the checkpoint knows them ----------------------------------------------------------------

def test_the_wrappers_infixes_are_stripped_as_dcp_strips_them():
    assert fqn("_orig_mod.layers.0._checkpoint_wrapped_module.lin.weight") == "layers.0.lin.weight"
    assert fqn("_fsdp_wrapped_module.model._fsdp_wrapped_module.embed.weight") == "model.embed.weight"
    assert fqn("layers.0.my_orig_mod.weight") == "layers.0.my_orig_mod.weight"  # whole levels only


def test_a_compiled_model_loads_and_saves_under_the_checkpoint_keys(checkpoint, tmp_path):
    model = torch.compile(torch.nn.Linear(4, 3))
    assert [n for n, _ in model.named_parameters()] == ["_orig_mod.weight", "_orig_mod.bias"]
    shardcast.load(model, checkpoint, progress=False)
    report = shardcast.save(model, tmp_path / "out", progress=False)
    from safetensors.torch import load_file
    assert sorted(load_file(str(tmp_path / "out" / "model.safetensors"))) == ["bias", "weight"]
    assert report.entries == 2


# ---- progress on a terminal ------------------------------------------------------------------------------

def _stderr_text(monkeypatch, stream, call):
    monkeypatch.setattr(sys, "stderr", stream)
    call()
    stream.flush()


def test_progress_is_on_by_default_when_stderr_is_a_terminal_on_rank_0_only(checkpoint, monkeypatch):
    import fcntl
    import struct
    import termios
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a new pty is 0 columns wide
    os.set_blocking(master, False)
    tty = os.fdopen(slave, "w")
    try:
        _stderr_text(monkeypatch, tty, lambda: shardcast.load(torch.nn.Linear(4, 3), checkpoint))
        shown = os.read(master, 65536).decode(errors="replace")
        assert "shardcast load" in shown, shown
        time.sleep(0.5)  # the first load's last refresh may reach the terminal late (tqdm): drained here, so
        while True:      # that what follows reads only the second load's output
            try:
                os.read(master, 65536)
            except BlockingIOError:
                break
        _stderr_text(monkeypatch, tty, lambda: shardcast.load(torch.nn.Linear(4, 3), checkpoint, progress=False))
        with pytest.raises(BlockingIOError):  # nothing written
            os.read(master, 65536)
        assert _progress(None, 1) is None  # other ranks never print
    finally:
        monkeypatch.undo()
        tty.close()
        os.close(master)


def test_progress_is_off_by_default_when_stderr_is_not_a_terminal(checkpoint, monkeypatch, tmp_path):
    with open(tmp_path / "stderr.txt", "w") as f:
        _stderr_text(monkeypatch, f, lambda: shardcast.load(torch.nn.Linear(4, 3), checkpoint))
        monkeypatch.undo()
    assert (tmp_path / "stderr.txt").read_text() == ""


# ---- typed reports ---------------------------------------------------------------------------------------

def test_load_and_save_return_typed_reports_that_still_are_the_dicts(checkpoint, tmp_path):
    report = shardcast.load(torch.nn.Linear(4, 3), checkpoint, progress=False)
    assert isinstance(report, shardcast.LoadReport) and isinstance(report.ranks[0], shardcast.LoadRank)
    d = report.to_dict()
    assert type(d) is dict and d == report and json.loads(json.dumps(report)) == d
    assert report["source"] == report.source == "each-rank" and report.get("nope", 7) == 7 and "ranks" in report
    assert report.world_size == 1 and report.total_bytes == 60 and report.ranks[0].bytes_stored == 60
    assert report.seconds == max(r["seconds"] for r in d["ranks"]) and report.gbps >= 0
    assert report.peak_rss_anon_bytes == d["ranks"][0]["peak_rss_anon_above_baseline"]
    d["source"] = "changed"
    assert report["source"] == "each-rank"  # to_dict is a copy
    with pytest.raises(AttributeError):
        report.source = "rank0"
    saved = shardcast.save(torch.nn.Linear(4, 3), tmp_path / "out", progress=False)
    assert isinstance(saved, shardcast.SaveReport) and isinstance(saved.ranks[0], shardcast.SaveRank)
    assert saved.source == saved["mode"] == "each-rank" and saved.files == ("model.safetensors",)
    assert saved.to_dict() == dict(saved) and saved.ranks[0].bytes_written == 60


# ---- ranks: wrapped models, and no teardown ritual ---------------------------------------------------------

def _wrapped_checkpoint(root: pathlib.Path):
    torch.manual_seed(1)
    sd = {}
    for i in range(2):
        sd.update({f"layers.{i}.lin.weight": torch.randn(7, 5), f"layers.{i}.lin.bias": torch.randn(7),
                   f"layers.{i}.scale": torch.randn(3)})
    sd.update({"head.weight": torch.randn(3, 7), "head.bias": torch.randn(3)})
    (root / "ckpt").mkdir()
    save_file(sd, str(root / "ckpt" / "model.safetensors"))


@pytest.mark.parametrize("world", [3])  # uneven rows (7 over 3 ranks: 3, 3, 1); W=2 added nothing to it
def test_wrapped_models_load_and_save_like_plain_ones_and_no_teardown_ritual_is_needed(tmp_path, world):
    _wrapped_checkpoint(tmp_path)
    results = ranks.run("conventions_worker.py", "all", tmp_path, world, tmp_path, timeout=240)
    exited = time.time()
    for rank, r in enumerate(results):
        w = r["wrapped"]
        assert any("_orig_mod." in n for n in w["names"]) and any("_checkpoint_wrapped_module." in n
                                                                   for n in w["names"]), w["names"]
        assert w["keys_equal"] and w["bad"] == [], (rank, w)
        assert r["teardown"]["destroy_seconds"] < 10, (rank, r["teardown"])
        # The result is written after destroy_process_group: the process exited soon after it.
        assert exited - os.path.getmtime(tmp_path / f"all-{world}.{rank}") < 30, rank
    plain, wrapped, ref = results[0]["wrapped"]["saved_keys"]
    assert plain == wrapped == ref and results[0]["wrapped"]["saved_bad"] == []


# ---- from_pretrained(model_cls=...) ------------------------------------------------------------------------

def test_from_pretrained_builds_the_model_class_it_is_given(tiny_checkpoints, tmp_path):
    root = tiny_checkpoints("rope-scaled", models=("llama",))
    (r,) = ranks.run("conventions_worker.py", "pretrained", root, 1, tmp_path, timeout=240)
    for name in ("default", "auto", "class", "callable"):
        assert r[name]["type"] == "FSDPLlamaForCausalLM" and r[name]["bad"] == [], (name, r[name])
        assert r[name]["loaded"] == r["default"]["loaded"] > 10, (name, r[name])
    assert r["bad_cls"][0] == "InvalidArgument" and "model_cls=42" in r["bad_cls"][1], r["bad_cls"]
