#!/usr/bin/env python3
"""Host-to-device copies from pinned memory, the way a load lands bytes on a GPU, against the bound.

  torch copy_    cuda_tensor.copy_(pinned_tensor): what shardcast's cuda target does with each staged chunk
                 (one cudaMemcpyAsync on the current stream, then a synchronize)
  cudaMemcpy     the CUDA runtime's own cudaMemcpy from the same pinned buffer into the same device buffer:
                 the bound for this GPU and bus

Each is timed with CUDA events (manual time, decimal GB/s), the median of --repeats, at each size; the
destination is checked against the source after every method (the `ok` column). JSON on stdout, one
object per size. Needs a CUDA device: without one it says "no CUDA device" and exits 1.

    python bench/bench_h2d.py [--sizes 64M,1G] [--repeats 20]
"""
import argparse
import ctypes
import ctypes.util
import json
import statistics
import sys


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def cudart():
    """The CUDA runtime torch itself loaded (the wheel's own libcudart), found in this process's maps."""
    with open("/proc/self/maps") as f:
        paths = sorted({line.split()[-1] for line in f if "libcudart.so" in line})
    if not paths:  # a torch that links the runtime statically: the system's, by its soname
        found = ctypes.util.find_library("cudart")
        if found is None:
            raise RuntimeError("no libcudart in this process or on the library path")
        paths = [found]
    lib = ctypes.CDLL(paths[0])
    lib.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.cudaMemcpy.restype = ctypes.c_int
    lib.cudaGetErrorString.argtypes = [ctypes.c_int]
    lib.cudaGetErrorString.restype = ctypes.c_char_p
    return lib


def timed(torch, fn, repeats: int) -> float:
    """Median seconds of fn() between CUDA events on the current stream (one warm-up first)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="64M,1G", help="comma-separated sizes (K/M/G binary); 64M is the default chunk")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    import torch
    if not torch.cuda.is_available():
        print(f"bench_h2d: no CUDA device (torch {torch.__version__}: torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    torch.cuda.init()
    lib = cudart()
    cuda_memcpy_h2d = 1  # cudaMemcpyHostToDevice
    for size in (parse_size(s) for s in args.sizes.split(",")):
        src = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        src.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
        dst = torch.empty(size, dtype=torch.uint8, device="cuda")
        row = {"bytes": size, "device": torch.cuda.get_device_name(), "pinned": src.is_pinned()}

        def raw(dst=dst, src=src, size=size):
            rc = lib.cudaMemcpy(dst.data_ptr(), src.data_ptr(), size, cuda_memcpy_h2d)
            if rc != 0:
                raise RuntimeError(f"cudaMemcpy: {lib.cudaGetErrorString(rc).decode()}")

        for name, fn in (("torch_copy", lambda dst=dst, src=src: dst.copy_(src)), ("cudamemcpy", raw)):
            dst.zero_()
            seconds = timed(torch, fn, args.repeats)
            row[f"{name}_gbps"] = size / seconds / 1e9
            row[f"{name}_ok"] = bool(torch.equal(dst.cpu(), src))
        row["ratio"] = row["torch_copy_gbps"] / row["cudamemcpy_gbps"]
        print(json.dumps(row), flush=True)
        del src, dst
    return 0


if __name__ == "__main__":
    sys.exit(main())
