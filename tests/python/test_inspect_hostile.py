"""`shardcast inspect` on hostile names: a path that is not UTF-8 still gives valid JSON, and keys
that carry terminal escape sequences are refused (control characters) or printed as visible escapes, never raw."""
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


# Control characters in a key are refused by the header parser (a key reaches every rank's error message);
# other characters that reorder or hide text (U+202E, the right-to-left override) load, and are shown escaped.
CONTROL = ["\x1b]0;pwned\x07title", "\x1b[2Jclear", "\u009b31mred", "tab\there", "nul\u0000key", "a\n[rank 2] forged"]
SHOWN = ["abc\u202efdp", "w"]


# Regression: keys were printed raw, so a checkpoint could set the title, clear the screen, recolour
# or reorder what the user sees.
def test_inspect_prints_escape_sequences_in_keys_as_visible_text(shardcast_bin, tmp_path):
    write_safetensors(tmp_path / "model.safetensors", SHOWN)
    r = inspect(shardcast_bin, tmp_path)
    assert r.returncode == 0, r.stderr
    text = r.stdout.decode("utf-8")
    assert "\u202e" not in text and "abc\\u202efdp" in text, text


@pytest.mark.parametrize("key", CONTROL)
def test_a_key_holding_a_control_character_is_refused_without_printing_it(shardcast_bin, tmp_path, key):
    write_safetensors(tmp_path / "model.safetensors", ["w", key])
    for flags in ((), (b"--json",)):
        r = inspect(shardcast_bin, tmp_path, *flags)
        assert r.returncode == 2, (r.stdout, r.stderr)
        err = r.stderr.decode("utf-8")
        assert "a tensor key holds a control character" in err and "model.safetensors" in err, err
        for bad in ("\x1b", "\x07", "\u009b", "\t", "\x00"):
            assert bad not in err, repr(bad)
        assert err.count("\n") == 1, err  # one line: a newline in the key forges none


def test_inspect_json_keeps_hostile_keys_exact_and_escaped(shardcast_bin, tmp_path):
    write_safetensors(tmp_path / "model.safetensors", SHOWN)
    r = inspect(shardcast_bin, tmp_path, b"--json")
    assert r.returncode == 0, r.stderr
    assert all(b < 0x80 for b in r.stdout), "JSON output is ASCII"
    assert not any(b < 0x20 and b not in b"\n" for b in r.stdout)
    assert sorted(t["key"] for t in json.loads(r.stdout)["tensors"]) == sorted(SHOWN)
