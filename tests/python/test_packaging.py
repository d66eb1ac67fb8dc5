"""The package as a product (issue 33): one version everywhere, `python -m shardcast`, the license, PEP 561
typing (py.typed and the extension's stub), and the INFO line a load leaves on logging.getLogger("shardcast").
One process, no ranks: fast."""
import ast
import logging
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import shardcast
from shardcast import _shardcast

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _pyproject() -> dict:
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _run(*args) -> str:
    r = subprocess.run(list(map(str, args)), capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert r.returncode == 0, (args, r.returncode, r.stdout, r.stderr)
    return r.stdout.strip()


def test_one_version_in_the_package_both_commands_and_pyproject(shardcast_bin):
    written = re.search(r'^__version__ = "([^"]+)"$', (ROOT / "python/shardcast/_version.py").read_text(), re.M)[1]
    assert shardcast.__version__ == written
    assert _run(shardcast_bin, "--version") == f"shardcast {written}"
    assert _run(sys.executable, "-m", "shardcast", "--version") == f"shardcast {written}"
    meta = _pyproject()
    assert "version" not in meta["project"] and "version" in meta["project"]["dynamic"]
    assert meta["tool"]["scikit-build"]["metadata"]["version"]["input"] == "python/shardcast/_version.py"


def test_python_m_shardcast_version_starts_without_torch():
    # Every module Python imported before exec'ing the command, from -X importtime's stderr.
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "shardcast", "--version"], capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert r.returncode == 0 and r.stdout.startswith("shardcast "), (r.stdout, r.stderr)
    imported = {line.rsplit("|", 1)[1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "shardcast._cli" in imported, sorted(imported)  # the listing is real: the entry itself is in it
    assert not {m for m in imported if m.split(".")[0] in ("torch", "numpy", "shardcast._shardcast")}, sorted(imported)


def test_a_bare_import_loads_no_torch_and_every_public_name_and_submodule_resolves():
    code = """if True:
        import sys
        import shardcast
        assert "torch" not in sys.modules, "import shardcast imported torch"
        assert shardcast.__version__
        from shardcast import load, ShardcastError, LoadReport          # from-imports resolve lazily
        assert load is shardcast.load and issubclass(shardcast.CommTimeout, ShardcastError)
        assert [n for n in shardcast.__all__ if not hasattr(shardcast, n)] == []
        assert set(shardcast.__all__) <= set(dir(shardcast))
        assert shardcast._pretrained.from_pretrained is shardcast.from_pretrained  # submodules on first access
        assert shardcast.dcp.StorageReader.__module__ == "shardcast.dcp._state_reader"
        try:
            shardcast.no_such_name
        except AttributeError as e:
            assert "no_such_name" in str(e), e
        else:
            raise AssertionError("shardcast.no_such_name resolved")
        ns = {}
        exec("from shardcast import *", ns)
        assert set(shardcast.__all__) <= set(ns), set(shardcast.__all__) - set(ns)
        print("ok")
    """
    assert _run(sys.executable, "-c", code) == "ok"


def test_python_m_shardcast_is_the_command(shardcast_bin):
    assert _run(sys.executable, "-m", "shardcast", "--help") == _run(shardcast_bin, "--help").replace(
        str(shardcast_bin), "shardcast")


def test_the_license_exists_and_pyproject_names_it():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License") and "the shardcast authors" in text
    project = _pyproject()["project"]
    assert project["license"] == "BSD-3-Clause" and project["license-files"] == ["LICENSE"]


def test_the_built_package_is_typed():
    pkg = pathlib.Path(shardcast.__file__).parent
    assert (pkg / "py.typed").is_file() and (pkg / "_shardcast.pyi").is_file(), pkg


def _stub_names() -> set:
    tree = ast.parse((ROOT / "python/shardcast/_shardcast.pyi").read_text())
    return {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and not n.name.startswith("_")}


def test_the_stub_names_every_function_and_class_of_the_extension_and_nothing_else():
    built = {n for n in dir(_shardcast) if not n.startswith("_")}
    stub = _stub_names()
    assert built - stub == set(), f"in the extension, missing from _shardcast.pyi: {sorted(built - stub)}"
    assert stub - built == set(), f"in _shardcast.pyi, not in the extension: {sorted(stub - built)}"


def test_the_stub_gives_each_function_its_arguments():
    tree = ast.parse((ROOT / "python/shardcast/_shardcast.pyi").read_text())
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
        doc = getattr(_shardcast, fn.name).__doc__  # pybind11's signature line: name(arg: type, ...) -> ...
        built = re.findall(r"(\w+): ", doc.splitlines()[0].split("(", 1)[1].rsplit(")", 1)[0])
        assert [a.arg for a in fn.args.posonlyargs + fn.args.args] == built, (fn.name, doc.splitlines()[0])


def test_the_stub_gives_each_exception_the_extensions_base():
    tree = ast.parse((ROOT / "python/shardcast/_shardcast.pyi").read_text())
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        base = RuntimeError if cls.bases[0].id == "RuntimeError" else getattr(_shardcast, cls.bases[0].id)
        assert getattr(_shardcast, cls.name).__bases__ == (base,), cls.name


def test_a_save_and_a_load_each_leave_one_info_line_on_the_shardcast_logger(tmp_path, caplog):
    torch.manual_seed(0)
    saved, loaded = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    with caplog.at_level(logging.INFO, logger="shardcast"):
        shardcast.save(saved, tmp_path / "ck")
        report = shardcast.load(loaded, tmp_path / "ck")
    lines = [r.getMessage() for r in caplog.records if r.name == "shardcast" and r.levelno == logging.INFO]
    assert len(lines) == 2, [r.getMessage() for r in caplog.records]
    where, rate = re.escape(str(tmp_path / "ck")), r" in \d+\.\d{3} s, \d+\.\d\d GB/s, "
    # 60 B: 15 float32. A save's source is its mode.
    assert re.fullmatch(f"save to {where}: 60 B{rate}(mode|source) each-rank, 1 rank\\(s\\), 1 file\\(s\\)", lines[0]), lines
    assert re.fullmatch(f"load of {where}: 60 B{rate}source {report['source']}, 1 rank\\(s\\)", lines[1]), lines
    assert torch.equal(loaded.weight, saved.weight) and torch.equal(loaded.bias, saved.bias)


def test_nothing_is_logged_below_info(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="shardcast"):
        shardcast.save(torch.nn.Linear(4, 3), tmp_path / "ck")
        shardcast.load(torch.nn.Linear(4, 3), tmp_path / "ck")
    assert [r for r in caplog.records if r.name == "shardcast"] == []


def test_from_pretrained_leaves_its_line_after_the_loads(tiny_checkpoints, caplog):
    path = tiny_checkpoints("tied", models=("llama",)) / "llama"
    with caplog.at_level(logging.INFO, logger="shardcast"):
        model = shardcast.from_pretrained(path)
    lines = [r.getMessage() for r in caplog.records if r.name == "shardcast" and r.levelno == logging.INFO]
    assert [line.split(" ", 1)[0] for line in lines] == ["load", "from_pretrained"], lines
    assert lines[1].startswith(f"from_pretrained of {path} ({type(model).__name__}): "), lines
    assert lines[1].split(": ", 1)[1] == lines[0].split(": ", 1)[1], lines  # the load's numbers
