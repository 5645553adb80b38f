"""The checksum of an offload file's records (kernels/checksum_cpu.c), compiled on first use.

Built like the other kernel libraries (optim/fused_cpu.py: the compiler search, cache folder,
flags and atomic publish; named ``zerompi_checksum_cpu-<hash>.so``). Without a C compiler the
checksum is zlib's CRC-32 (about a fifth of the speed here): the values are kept only in the
memory of the process that wrote the file, so the two never meet. :func:`checksum` hashes
``nbytes`` bytes at an address, chained through ``seed``.
"""
import ctypes
import zlib
from typing import Callable

from ...optim.fused_cpu import BuildError, build, lazy_library

SOURCE = "checksum_cpu.c"
PREFIX = "zerompi_checksum_cpu"
ABI_VERSION = 1                      # must match ZCK_ABI_VERSION in the C source


def _load():
    path = build(source=SOURCE, headers=(), prefix=PREFIX)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise BuildError(f"cannot load {path}: {e}")
    if lib.zck_abi_version() != ABI_VERSION:
        raise BuildError(f"{path} has ABI {lib.zck_abi_version()}, expected {ABI_VERSION}")
    lib.zck_checksum.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64]
    lib.zck_checksum.restype = ctypes.c_uint64
    return lib


_library = lazy_library(_load)


def _crc32(address: int, nbytes: int, seed: int) -> int:
    return zlib.crc32((ctypes.c_char * nbytes).from_address(address), seed & 0xFFFFFFFF)


def checksum_library():
    """The C hash's library (``zck_checksum``), or None when it does not build here."""
    return _library()[0]


def checksum_function() -> Callable[[int, int, int], int]:
    """``f(address, nbytes, seed) -> int``: the C hash when its library loads, else CRC-32."""
    lib = checksum_library()
    return lib.zck_checksum if lib is not None else _crc32
