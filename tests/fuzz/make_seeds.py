#!/usr/bin/env python3
"""Regenerates the seed corpus in tests/fuzz/corpus/<target>/ (stdlib only, deterministic).

The header and checkpoint seeds are built from the reference samples in
../shared/data/safetensors-samples (written by the safetensors library; Unlicense). Fuzzers read
these directories and never write to them: tools/test.sh gives each target a working corpus in
build-asan/fuzz-corpus/<target>/.
"""
import json
import pathlib
import random
import shutil
import struct

HERE = pathlib.Path(__file__).resolve().parent
SAMPLES = HERE.parents[2] / "shared" / "data" / "safetensors-samples"
OUT = HERE / "corpus"


def write(target, name, data):
    d = OUT / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data if isinstance(data, bytes) else data.encode())


def sample(name):
    return (SAMPLES / f"{name}.safetensors").read_bytes()


def header_seeds():
    for p in sorted(SAMPLES.glob("*.safetensors")):
        write("header_fuzzer", p.name, p.read_bytes())


def index_seeds():
    write("index_fuzzer", "hf_sharded.json", json.dumps({
        "metadata": {"total_size": 16060522496},
        "weight_map": {
            "lm_head.weight": "model-00004-of-00004.safetensors",
            "model.embed_tokens.weight": "model-00001-of-00004.safetensors",
            "model.layers.0.self_attn.q_proj.weight": "model-00001-of-00004.safetensors",
            "model.layers.31.mlp.down_proj.weight": "model-00004-of-00004.safetensors",
        }}, indent=2))
    write("index_fuzzer", "nested_metadata.json", json.dumps({
        "metadata": {"total_size": 12, "format": "pt", "list": [1, -2, 3.5, True, None, {"k": "v"}], "e": "\u00e9\u2028"},
        "weight_map": {"a": "sub/a.safetensors", "b\u0001": "./b.safetensors", "c": "dir/c.safetensors"},
        "extra": [[{"weight_map": 7}]]}))
    write("index_fuzzer", "duplicate_nested.json", '{"metadata":{"a":1,"a":2},"weight_map":{"x":"a"}}')
    write("index_fuzzer", "dotdot.json", '{"weight_map":{"x":"../x.safetensors","y":"/abs","z":""}}')
    write("index_fuzzer", "deep.json", '{"weight_map":{"x":"a"},"m":' + "[" * 70 + "]" * 70 + "}")
    write("index_fuzzer", "escapes.json", r'{"weight_map":{"\u001b[31mred":"a\u0000b","k":"\ud83d\ude00.safetensors"}}')


def frame(flags, index, a, b=b""):
    return bytes([flags]) + struct.pack("<H", len(index)) + index + struct.pack("<H", len(a)) + a + b


def safetensors(tensors):
    """A safetensors file of (name, dtype, shape, data) in order, as the library lays one out."""
    header, data = {}, b""
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def quantized_seeds():
    """The quantized pairs the checkpoint fuzzer pairs and dequantizes: MXFP4 blocks + scales, an NVFP4
    triple (with its input_scale), and fp8 with its block scale."""
    rng = random.Random(3)
    raw = lambda n: bytes(rng.randrange(256) for _ in range(n))
    mxfp4 = safetensors([("e.experts_blocks", "U8", [2, 3, 1, 16], raw(96)),
                         ("e.experts_scales", "U8", [2, 3, 1], bytes([120, 127, 130, 1, 255, 0]))])
    nvfp4 = safetensors([("m.input_scale", "F32", [], struct.pack("<f", 1.0)),
                         ("m.weight", "U8", [2, 16], raw(32)),
                         ("m.weight_scale", "F8_E4M3", [2, 2], bytes([0x38, 0x7F, 0x01, 0x50])),
                         ("m.weight_scale_2", "F32", [], struct.pack("<f", 0.37))])
    fp8 = safetensors([("f.weight", "F8_E4M3", [2, 2], raw(4)),
                       ("f.weight_scale_inv", "F32", [1, 1], struct.pack("<f", 0.5))])
    write("checkpoint_fuzzer", "mxfp4_pair", frame(0b000000, b"", mxfp4))
    write("checkpoint_fuzzer", "nvfp4_triple", frame(0b000000, b"", nvfp4))
    write("checkpoint_fuzzer", "fp8_and_scale", frame(0b000000, b"", fp8))


def checkpoint_seeds():
    idx = lambda wm: json.dumps({"metadata": {"total_size": 0}, "weight_map": wm}).encode()
    write("checkpoint_fuzzer", "index_two_files",
          frame(0b000011, idx({"B": "a.safetensors", "d": "b.safetensors"}), sample("B"), sample("d")))
    write("checkpoint_fuzzer", "single_file", frame(0b000000, b"", sample("overall")))
    write("checkpoint_fuzzer", "pread_symlinks",
          frame(0b101111, idx({"f": "c.safetensors", "i": "sub/b.safetensors"}), sample("f"), sample("i")))
    write("checkpoint_fuzzer", "open_file_path", frame(0b010000, b"", sample("e")))
    write("checkpoint_fuzzer", "missing_and_dot",
          frame(0b000001, idx({"H": "./a.safetensors", "h": "gone.safetensors"}), sample("H")))
    write("checkpoint_fuzzer", "key_in_wrong_file",
          frame(0b000011, idx({"b": "a.safetensors", "B": "b.safetensors"}), sample("B"), sample("b")))


def read_seeds():
    rng = random.Random(20240611)
    for i, n in enumerate((16, 48, 96, 200, 400)):
        write("read_fuzzer", f"random_{i}", bytes(rng.randrange(256) for _ in range(n)))


if __name__ == "__main__":
    shutil.rmtree(OUT, ignore_errors=True)
    header_seeds()
    index_seeds()
    checkpoint_seeds()
    quantized_seeds()
    read_seeds()
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"{sum(1 for p in OUT.rglob('*') if p.is_file())} seeds, {total} bytes in {OUT}")
