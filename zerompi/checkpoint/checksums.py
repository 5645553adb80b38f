"""The checksums of shard files and offload records: CRC-32 (a checkpoint's shards, format 2), sha256 (format 1),
and zck64, the 64-bit hash of kernels/checksum_cpu.c (the in-memory replicas' shards, an offload file's records).

zck64's kernel is compiled on first use like the other kernel libraries (optim/fused_cpu.py: the compiler search,
cache folder, flags and atomic publish; named ``zerompi_checksum_cpu-<hash>.so``): eight lanes of multiply-rotate
rounds at memory bandwidth (1.2 ms for 14 MB here, against 4.0 ms for zlib's CRC-32). Like CRC-32 it finds a torn,
truncated or damaged file, not a forger. Without a C compiler: the replicas write CRC-32 entries instead, and an
offload file's records are hashed by CRC-32 (their values stay in the writing process's memory: the two never meet).
"""
import ctypes
import hashlib
import mmap
import zlib
from typing import Callable, Optional

import numpy as np

from ..optim.fused_cpu import build, lazy_library, open_checked

SOURCE = "checksum_cpu.c"
PREFIX = "zerompi_checksum_cpu"
ABI_VERSION = 2                      # must match ZCK_ABI_VERSION in the C source
ZCK64 = "zck64"                      # a shard entry's key for zck64
CHECKSUM_KINDS = ("crc32", ZCK64, "sha256")   # a shard entry's key: format 2's, the replicas', format 1's
CHUNK_BYTES = 4 << 20                # read size when checksumming a file by CRC-32 or sha256


class Crc32:
    """zlib's CRC-32 (the gzip and zip polynomial) as a running checksum: ``update``, ``hexdigest``.

    A shard's checksum (format 2): it finds any change of up to 4 bytes in a row, and misses
    other damage with odds 2**-32, at a quarter of sha256's CPU time (docs/checkpoint.md)."""

    def __init__(self):
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)    # releases the GIL on large buffers

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def _load():
    lib = open_checked(build(source=SOURCE, headers=(), prefix=PREFIX), "zck_abi_version", ABI_VERSION)
    lib.zck_checksum.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64]
    lib.zck_checksum.restype = ctypes.c_uint64
    lib.zck_state_size.restype = ctypes.c_int64
    lib.zck_init.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
    lib.zck_update.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.zck_copy_update.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.zck_final.argtypes = [ctypes.c_void_p]
    lib.zck_final.restype = ctypes.c_uint64
    return lib


_library = lazy_library(_load)


def checksum_library():
    """The C hash's library (``zck_checksum``), or None when it does not build here."""
    return _library()[0]


def _crc32(address: int, nbytes: int, seed: int) -> int:
    return zlib.crc32((ctypes.c_char * nbytes).from_address(address), seed & 0xFFFFFFFF)


def checksum_function() -> Callable[[int, int, int], int]:
    """``f(address, nbytes, seed) -> int``, hashing ``nbytes`` bytes at an address chained through ``seed``: the C
    hash when its library loads, else CRC-32 (an offload file's records)."""
    lib = checksum_library()
    return lib.zck_checksum if lib is not None else _crc32


def zck64(buffer) -> Optional[str]:
    """zck64 over ``buffer`` (bytes-like, e.g. a file's mapping) in one call, as 16 hex digits; None when the
    kernel does not build here."""
    lib = checksum_library()
    if lib is None:
        return None
    data = np.frombuffer(buffer, np.uint8)
    try:
        return f"{lib.zck_checksum(data.ctypes.data, data.nbytes, 0):016x}"
    finally:
        del data                               # the mapping's export released before its owner may close it


class Zck64Stream:
    """zck64 fed in pieces (``update``, ``copy``), equal to :func:`zck64` over their concatenation: a replica's
    shard file hashed as it is written, each piece copied and hashed in one pass (``copy``)."""

    def __init__(self, lib):
        self._lib = lib
        self._state = ctypes.create_string_buffer(lib.zck_state_size())
        lib.zck_init(self._state, 0)

    def update(self, data: np.ndarray) -> None:
        """Hash ``data`` (a contiguous array, any dtype: its bytes)."""
        self._lib.zck_update(self._state, data.ctypes.data, data.nbytes)

    def copy(self, dst: np.ndarray, src) -> None:
        """``dst[...] = src`` and hash ``dst``'s bytes: one pass where both are contiguous arrays of one dtype,
        else NumPy's copy (a cast) and then the hash."""
        if (isinstance(src, np.ndarray) and src.dtype == dst.dtype and src.shape == dst.shape
                and src.flags.c_contiguous and dst.flags.c_contiguous):
            self._lib.zck_copy_update(self._state, dst.ctypes.data, src.ctypes.data, dst.nbytes)
        else:
            np.copyto(dst, src)
            self.update(dst)

    def hexdigest(self) -> str:
        return f"{self._lib.zck_final(self._state):016x}"


def zck64_stream() -> Optional[Zck64Stream]:
    """A fresh :class:`Zck64Stream`, or None when the kernel does not build here."""
    lib = checksum_library()
    return None if lib is None else Zck64Stream(lib)


def entry_kind(entry: dict) -> str:
    """The checksum a shard's manifest entry carries (its key)."""
    return next((k for k in CHECKSUM_KINDS if k in entry), "sha256")


def file_checksum(path: str, kind: str) -> Optional[str]:
    """The ``kind`` checksum of the file at ``path`` (None: zck64, whose kernel does not build here)."""
    if kind == ZCK64:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            return zck64(view)
    check = Crc32() if kind == "crc32" else hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK_BYTES), b""):
            check.update(block)
    return check.hexdigest()
