"""safetensors files, read and written a piece at a time: their header, a tensor's bytes, the shard index.

The format (huggingface/safetensors): 8 bytes little-endian N, N bytes of JSON (each tensor's dtype,
shape and [begin, end) byte offsets into the data that follows; ``__metadata__`` strings), then the
data. Written here from a plan of every tensor's name, dtype and shape: the header first, then each
tensor's bytes streamed in order, so no tensor, let alone a shard, is held whole in memory (the
``safetensors`` package writes a dict of whole tensors). Read through a memory map of the data, one
run of a tensor at a time. A sharded model adds ``model.safetensors.index.json`` (tensor -> file).
"""
import json
import os
import re
import struct
from typing import Dict, List, NamedTuple, Sequence, Tuple

import numpy as np

from ..errors import ConfigError

HEADER_LIMIT = 100 << 20            # the safetensors package refuses larger headers too
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


def numpy_dtype(st: str) -> np.dtype:
    """NumPy's dtype of the safetensors dtype ``st`` (BF16: ml_dtypes' bfloat16)."""
    if st == "BF16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype({"F64": "<f8", "F32": "<f4", "F16": "<f2"}[st])


def parse_size(text: str) -> int:
    """Bytes of a size such as ``2GB``, ``500MB``, ``10GiB`` or ``1000`` (decimal units, as Hugging Face's)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ConfigError(f"max_shard_size={text!r} is not a size; use e.g. 2GB, 500MB or a number of bytes")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
             "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}[unit]
    size = int(float(m.group(1)) * scale)
    if size < 1:
        raise ConfigError(f"max_shard_size={text!r} must be at least one byte")
    return size


class Entry(NamedTuple):
    """One tensor of a file: its safetensors dtype, shape and [begin, end) offsets into the data."""
    dtype: str
    shape: Tuple[int, ...]
    begin: int
    end: int


def plan_shards(tensors: Sequence[Tuple[str, str, Tuple[int, ...]]], max_bytes: int) -> List[List[int]]:
    """Indices of ``tensors`` ((name, dtype, shape) in order) per file: filled in order up to ``max_bytes`` each
    (a larger tensor alone in its file, as Hugging Face cuts them)."""
    files: List[List[int]] = [[]]
    used = 0
    for i, (_, dtype, shape) in enumerate(tensors):
        n = ITEMSIZE[dtype] * int(np.prod(shape, dtype=np.int64))
        if files[-1] and used + n > max_bytes:
            files.append([])
            used = 0
        files[-1].append(i)
        used += n
    return files


def shard_names(count: int) -> List[str]:
    """The file names of a model in ``count`` files (Hugging Face's)."""
    return [SINGLE] if count == 1 else [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]


class StreamWriter:
    """One safetensors file written tensor by tensor: the header from ``tensors`` ((name, dtype, shape)), then
    ``write`` each tensor's bytes in the same order (in as many pieces as wanted); ``close`` checks the count."""

    def __init__(self, path: str, tensors: Sequence[Tuple[str, str, Tuple[int, ...]]], metadata: Dict[str, str]):
        header, at = {"__metadata__": dict(metadata)}, 0
        for name, dtype, shape in tensors:
            n = ITEMSIZE[dtype] * int(np.prod(shape, dtype=np.int64))
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + n]}
            at += n
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)            # the data starts 8-byte aligned
        self.size, self.written = at, 0
        self.f = open(path, "xb")
        self.f.write(struct.pack("<Q", len(text)) + text)

    def write(self, data: np.ndarray) -> None:
        self.f.write(np.ascontiguousarray(data).view(np.uint8).data)   # bytes: bfloat16 has no buffer format
        self.written += data.nbytes

    def close(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        if self.written != self.size:
            raise RuntimeError(f"{self.f.name}: wrote {self.written} bytes of tensors, the header says {self.size}")


def read_header(path: str) -> Tuple[int, Dict[str, Entry]]:
    """(where the data starts, {name: Entry}) of the safetensors file ``path``; ConfigError naming the file."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 2 <= n <= min(HEADER_LIMIT, size - 8):
                raise ConfigError(f"{path}: not a safetensors file (header length {n}, file {size} bytes)")
            raw = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the safetensors header: {e}")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: not a safetensors file (its header is not a JSON object)")
    start, out = 8 + n, {}
    for name, e in raw.items():
        if name == "__metadata__":
            continue
        try:
            entry = Entry(e["dtype"], tuple(int(d) for d in e["shape"]), *(int(x) for x in e["data_offsets"]))
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"{path}: tensor {name!r} has a malformed header entry {e!r}")
        if entry.dtype not in ITEMSIZE:
            raise ConfigError(f"{path}: tensor {name!r} is {entry.dtype}; zerompi reads {', '.join(ITEMSIZE)}")
        want = ITEMSIZE[entry.dtype] * int(np.prod(entry.shape, dtype=np.int64))
        if entry.end - entry.begin != want or entry.begin < 0 or start + entry.end > size:
            raise ConfigError(f"{path}: tensor {name!r} ({entry.dtype} {list(entry.shape)}) has data offsets "
                              f"[{entry.begin}, {entry.end}) that do not fit it or the file ({size} bytes)")
        out[name] = entry
    return start, out


class MappedTensor:
    """One tensor of a safetensors file, memory-mapped (nothing read until asked): ``read(lo, hi)`` gives its
    flattened elements lo .. hi-1 as float32."""

    def __init__(self, path: str, start: int, entry: Entry):
        self.path, self.entry = path, entry
        self.count = int(np.prod(entry.shape, dtype=np.int64))
        self._map = None
        self._offset = start + entry.begin

    def read(self, lo: int, hi: int) -> np.ndarray:
        if self._map is None:
            self._map = np.memmap(self.path, numpy_dtype(self.entry.dtype), "r", self._offset, (self.count,))
        return np.asarray(self._map[lo:hi], np.float32)
