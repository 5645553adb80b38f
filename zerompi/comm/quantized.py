"""Quantized communication (ZeRO++): what travels is int8 or int4 blocks with a float32 scale each.

**The wire format of one slice** of k elements: the quantized values (k bytes for int8,
(k + 1) // 2 for int4), padded to a multiple of 4 bytes, then one float32 scale per block of
``block`` elements (kernels/quant_math.h). Every slice of a bucket has the same length, so a
bucket travels as ``size`` equal wire blocks, in slot order, like its unquantized slices.

- **qgZ** (gradients): the Communicator's reduce-scatter with ``quant``: each rank quantizes
  every slice of its gradient bucket, an all-to-all sends slice r to rank r, and the
  receiver dequantizes the N rows and sums them in fp32 in rank order (one fused kernel).
  Across nodes each level does so: the node's partial sum is re-quantized before it crosses.
- **qwZ** (weights): :class:`QuantizedGather` quantizes this rank's slice into its wire block,
  all-gathers the wire blocks (flat or in two levels), and dequantizes every slice, its own
  included, into the stored dtype: every rank then holds the same values. The fp32 master
  stays exact; only what travels is quantized.

Bytes are counted as they travel (payload + scales); each counter also keeps the logical
bytes, what would have moved unquantized, so the saving is visible.
"""
from dataclasses import dataclass

import numpy as np

from ..errors import check
from ..optim import impl
from ..optim.reference import quantized_bytes
from .signature import signature

BITS = {"int8": 8, "int4": 4}
DEFAULT_BLOCK = 64     # elements per scale (docs/quantized.md: int4 gradients need blocks this small)


def check_quantization(weights=None, grads=None, block: int = DEFAULT_BLOCK) -> None:
    """ConfigError naming the value unless ``weights`` (None or "int8"), ``grads`` (None, "int8" or
    "int4") and ``block`` (a power of two >= 8) are allowed: the one rule of the engine's config,
    the train and estimate command lines and the bench."""
    check(weights in (None, "int8"), f"quantize_weights={weights!r} is not allowed; use None or 'int8' (int4 "
                                     "weights are not offered: too coarse for parameters)")
    check(grads in (None, "int8", "int4"), f"quantize_grads={grads!r} is not allowed; use None, 'int8' or 'int4'")
    check(isinstance(block, int) and not isinstance(block, bool) and block >= 8 and block & (block - 1) == 0,
          f"quant_block={block!r} is not allowed; use a power of two >= 8 (elements per scale)")


@dataclass(frozen=True)
class Quantization:
    """``bits`` 8 or 4; ``block`` elements per scale (a power of two >= 8)."""
    bits: int
    block: int

    def payload_bytes(self, k: int) -> int:
        """Bytes of the quantized values of a k-element slice, padded to a multiple of 4."""
        return -(-quantized_bytes(k, self.bits) // 4) * 4

    def wire_bytes(self, k: int) -> int:
        """Bytes one k-element slice travels as: the values, then one float32 scale per block."""
        return self.payload_bytes(k) + 4 * -(-k // self.block)

    def pack(self, x, wire) -> None:
        """Quantize the slice ``x`` into its wire block ``wire`` (uint8, wire_bytes(x.size) long;
        host or device, as ``x``)."""
        q, scales = impl.quantize_any(x, self.bits, self.block)
        p = self.payload_bytes(x.size)
        wire[:q.size] = q
        wire[p:].view(np.float32)[...] = scales

    def rows(self, wire, k: int):
        """(values, scales) views of a wire block of a k-element slice."""
        p = self.payload_bytes(k)
        return wire[:p], wire[p:].view(np.float32)


def quantization(name, block: int):
    """The Quantization for a config name ("int8", "int4"), or None for None."""
    return None if name is None else Quantization(BITS[name], block)


class QuantizedHandle:
    """A collective on wire blocks; ``finish`` (the dequantization) runs once it has arrived."""

    def __init__(self, inner, finish):
        self.inner, self._finish = inner, finish
        self.op, self.tag = inner.op, inner.tag

    def test(self) -> bool:
        return self.inner.test()

    def wait(self) -> None:
        self.inner.wait()
        if self._finish is not None:
            self._finish()
            self._finish = None


class QuantizedGather:
    """qwZ: an in-place all-gather over ``comm`` (flat or two-level) that moves wire blocks."""

    def __init__(self, comm, quant: Quantization):
        self.comm, self.quant = comm, quant
        self._spare = {}           # wire buffer length -> spare buffers

    def iall_gather(self, buf, tag=None) -> QuantizedHandle:
        n, q = self.comm.size, self.quant
        flat = buf.reshape(-1)
        k = flat.size // n
        wb = q.wire_bytes(k)
        spare = self._spare.get(wb * n)
        wire = spare.pop() if spare else impl.array_module(flat).empty(wb * n, np.uint8)   # host or device
        slot = self.comm.slot
        q.pack(flat[slot * k:(slot + 1) * k], wire[slot * wb:(slot + 1) * wb])
        sig = signature("all_gather", flat.dtype, flat.size, tag, quant=q)   # checked as the unquantized buffer
        inner = self.comm.iall_gather(wire, tag, logical_block=k * flat.itemsize, sig=sig)

        def finish():
            for s in range(n):
                values, scales = q.rows(wire[s * wb:(s + 1) * wb], k)
                impl.dequant_sum_any([values], [scales], k, q.bits, q.block, flat[s * k:(s + 1) * k], 1.0, False)
            self._spare.setdefault(wire.size, []).append(wire)

        return QuantizedHandle(inner, finish)

    def all_gather(self, buf, tag=None) -> None:
        self.iall_gather(buf, tag).wait()
