"""How much of a set of files is in the page cache: mincore(2) over a read-only mapping of each file.

fincore (util-linux) does the same but is not on every machine (the lent GPU image has none); this needs
only libc. A mapping that is never touched faults nothing in, so counting changes nothing it counts.
"""
import ctypes
import ctypes.util
import mmap
import os

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_bytes(path) -> int:
    """Bytes of the file at `path` in the page cache (whole pages; the last one counts whole)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    page = mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        try:
            pages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
            return min(size, (pages - bytes(vec).count(0)) * page)  # mincore sets bit 0 alone
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def resident(files) -> tuple:
    """(resident bytes, total bytes) of the files together."""
    res = total = 0
    for f in files:
        res += resident_bytes(f)
        total += os.path.getsize(f)
    return res, total
