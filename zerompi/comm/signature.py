"""Collectives that check what the ranks pass together: a signature rides with the data.

Ranks that call one collective with different lengths, dtypes or operations got silently
wrong sums (MPI pairs the messages anyway), garbage (fp16 summed as fp32), a hang, or, under
Open MPI, a receive buffer overrun (a longer message than the buffer posted for it is written
past its end: measured with Open MPI 5.0.11). So every public collective is a set of
point-to-point messages on a private duplicate of the communicator (comm/checked.py), two to
and from every peer:

- a **header**, HEADER_BYTES: this rank's signature (:func:`signature`): the operation, the
  dtype, the buffer's elements, the quantization, the caller's label (bucket, step), the scale
  and whether the result accumulates;
- the **data**, tagged with a hash of that signature's shape (the operation, dtype, length and
  quantization: what fixes its size), so that it only matches a receive posted for the same
  shape: a message of another length is never received into a buffer made for this one.

Before any result is used, the headers are compared; when any two differ, every rank raises
the same MismatchError naming the ranks and what each passed (every rank has every header).
The data of the ranks whose shapes disagree is then never received; the job ends on the error. Bytes:
the headers are counted apart (``Communicator.check_stats``), never in the operations' counters.
"""
import struct
import zlib
from typing import Dict, Sequence

import numpy as np

from .consistency import rank_set

WORDS = ("operation", "dtype", "length", "quantization", "bucket", "step", "scale", "accumulate")   # an int64 each
HEADER = struct.Struct("<8q")    # a signature as it travels: one little-endian int64 per word (scale: its float64 bits)
HEADER_BYTES = HEADER.size       # bytes of one header message
HEADER_TAG = 0                   # the headers' tag; the data's: 1 + a hash of the signature's shape
SHAPE_BYTES = 4 * 8              # the shape: the first 4 words (operation, dtype, length, quantization)
MAX_TAG = 2 ** 29 - 1            # MPICH's upper bound of tags (Open MPI's is 2**31 - 1; MPI promises 32767)
_NAMES: Dict[int, str] = {}      # code -> name of every operation, dtype and label this process signed
_CODES: Dict[str, int] = {}      # name -> code, the other way (a signature is made for every collective: cheap)
_BITS: Dict[float, int] = {}     # scale -> its float64 bits, as an int64
_DTYPES: Dict[object, int] = {}  # dtype -> the code of its name


def _code(name: str) -> int:
    """A name as a number that is the same in every process (crc32), remembered to name it back."""
    code = _CODES.get(name)
    if code is None:
        code = _CODES[name] = zlib.crc32(name.encode())
        _NAMES.setdefault(code, name)
    return code


for _name in ("reduce_scatter", "all_gather", "all_reduce", "gather_scalars", "sum_scalars", "tp_all_reduce",
              "tp_sum_scalars", "bench_tp_all_reduce", "float16", "float32", "float64", "bfloat16", "uint8", "int8",
              "int16", "int32", "int64", "complex64", "complex128"):
    _code(_name)                 # named in a message even when only another rank signed them


def _label(tag):
    """(bucket, step) words of a caller's label: None, a bucket index, or the engine's (bucket, step)."""
    if tag is None:
        return -1, -1
    if type(tag) is tuple and len(tag) == 2:
        bucket, step = tag
        if (bucket is None or type(bucket) is int) and (step is None or type(step) is int):   # the engine's: fast
            return -1 if bucket is None else bucket, -1 if step is None else step
        if all(t is None or _is_int(t) for t in tag):
            return -1 if bucket is None else int(bucket), -1 if step is None else int(step)
    if _is_int(tag):
        return int(tag), -1
    return -2 - _code(repr(tag)), -1          # any other label: its repr's code, below -1


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _dtype_code(dtype) -> int:
    code = _DTYPES.get(dtype)         # np.dtype.name is built anew at every read: slow for every collective
    if code is None:
        code = _DTYPES[dtype] = _code(np.dtype(dtype).name)
    return code


def _scale_bits(scale: float) -> int:
    bits = _BITS.get(scale)
    if bits is None:
        bits = _BITS[scale] = struct.unpack("<q", struct.pack("<d", float(scale)))[0]
    return bits


def signature(op: str, dtype, elements: int, tag=None, scale: float = 1.0, accumulate: bool = False,
              quant=None) -> bytes:
    """What one rank passes to one collective, as its HEADER_BYTES header (module docstring).

    ``elements``: of the whole buffer (a reduce-scatter's send, an all-gather's buffer), unquantized;
    ``quant``: a comm.quantized.Quantization, or None."""
    bucket, step = _label(tag)
    q = 0 if quant is None else quant.bits << 32 | quant.block
    return HEADER.pack(_code(op), _dtype_code(dtype), elements, q, bucket, step, _scale_bits(scale),
                       1 if accumulate else 0)


def describe(header: bytes) -> str:
    """'reduce_scatter of 1,024 float32 (bucket 2, step 7)' from a signature's header."""
    op, dtype, elements, q, bucket, step, bits, accumulate = HEADER.unpack(header)
    text = f"{_NAMES.get(op, f'operation #{op}')} of {elements:,} {_NAMES.get(dtype, f'dtype #{dtype}')}"
    if q:
        text += f" as int{q >> 32} blocks of {q & 0xFFFFFFFF}"
    scale = struct.unpack("<d", struct.pack("<q", bits))[0]
    if scale != 1.0:
        text += f", scale {scale:.6g}"
    if accumulate:
        text += ", accumulated"
    if bucket <= -2:
        text += f" ({_NAMES.get(-2 - bucket, 'a label')})"
    elif bucket >= 0 or step >= 0:
        parts = (bucket >= 0 and f"bucket {bucket}", step >= 0 and f"step {step}")
        text += " (" + ", ".join(p for p in parts if p) + ")"
    return text


def mismatch_message(headers: Sequence[bytes], ranks: Sequence[int]) -> str:
    """One line naming what each rank passed (``headers``: every rank's signature, in the
    communicator's rank order; ``ranks``: their world ranks) and in which words they differ."""
    groups: Dict[bytes, list] = {}
    for header, rank in zip(headers, ranks):
        groups.setdefault(bytes(header), []).append(rank)
    words = [HEADER.unpack(h) for h in headers]
    differ = [name for i, name in enumerate(WORDS) if len({w[i] for w in words}) > 1]
    parts = "; ".join(f"{describe(h)} on {rank_set(rs)}" for h, rs in groups.items())
    return (f"collective mismatch between ranks: {parts} (they differ in: {', '.join(differ)}); every rank must call "
            "the same collectives in the same order, with buffers of the same length and dtype")
