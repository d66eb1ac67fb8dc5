"""`shardcast inspect` on hostile names: a path that is not UTF-8 still gives valid JSON, and keys
that carry terminal escape sequences are printed as visible escapes, never raw."""
import json
import os
import subprocess

import pytest


def write_safetensors(path, keys):
    header = {k: {"dtype": "U8", "shape": [2], "data_offsets": [2 * i, 2 * i + 2]} for i, k in enumerate(keys)}
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + b"\x01\x02" * len(keys))


def inspect(shardcast_bin, path, *flags):
    return subprocess.run([os.fsencode(shardcast_bin), b"inspect", os.fsencode(path), *flags],
                          capture_output=True, timeout=120)


# Regression: nlohmann's dump threw type_error.316 on the path's invalid UTF-8.
def test_inspect_json_of_a_non_utf8_path_is_valid_json(shardcast_bin, tmp_path):
    d = os.path.join(os.fsencode(tmp_path), b"ckpt-\xff\xfe")
    os.mkdir(d)
    write_safetensors(os.path.join(d, b"model.safetensors"), ["w"])
    r = inspect(shardcast_bin, d, b"--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.decode("ascii"))
    assert out["path"].endswith("ckpt-\ufffd\ufffd")
    assert [t["key"] for t in out["tensors"]] == ["w"]


HOSTILE = ["\x1b]0;pwned\x07title", "\x1b[2Jclear", "\u009b31mred", "abc\u202efdp", "tab\there", "nul\u0000key"]


# Regression: keys were printed raw, so a checkpoint could set the title, clear the screen, recolour
# or reorder what the user sees.
def test_inspect_prints_escape_sequences_in_keys_as_visible_text(shardcast_bin, tmp_path):
    write_safetensors(tmp_path / "model.safetensors", HOSTILE)
    r = inspect(shardcast_bin, tmp_path)
    assert r.returncode == 0, r.stderr
    text = r.stdout.decode("utf-8")
    for bad in ("\x1b", "\x07", "\u009b", "\u202e", "\t", "\x00"):
        assert bad not in text, repr(bad)
    for shown in ("\\x1b]0;pwned\\x07title", "\\x1b[2Jclear", "\\u009b31mred", "abc\\u202efdp", "tab\\there",
                  "nul\\x00key"):
        assert shown in text, (shown, text)


def test_inspect_json_keeps_hostile_keys_exact_and_escaped(shardcast_bin, tmp_path):
    write_safetensors(tmp_path / "model.safetensors", HOSTILE)
    r = inspect(shardcast_bin, tmp_path, b"--json")
    assert r.returncode == 0, r.stderr
    assert all(b < 0x80 for b in r.stdout), "JSON output is ASCII"
    assert not any(b < 0x20 and b not in b"\n" for b in r.stdout)
    assert sorted(t["key"] for t in json.loads(r.stdout)["tensors"]) == sorted(HOSTILE)
