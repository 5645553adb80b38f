"""``zerompi.bench --impl zerompi-q8,zerompi-q4``: the quantized collectives (ZeRO++ qgZ and qwZ).

One concern: the rows of the quantized reduce-scatter and all-gather, as the engine calls them
(``Communicator.ireduce_scatter(..., quant=)``, ``comm.quantized.QuantizedGather``; with
--node-size the two-level forms, each level quantizing what it sends), and their check.

**Bytes.** ``bytes`` stays the logical size (the buffer unquantized), so algbw and busbw compare
with the unquantized rows; ``wire_bytes`` is the whole buffer as it travels: N slices of k
elements, each ``Quantization.wire_bytes(k)`` (values padded to 4 bytes, a float32 scale per block).

**The error** of an element, with the float64 sum of the ranks' inputs (reduce-scatter) or the
owner's input (all-gather) as ``exact``, is ``|result - exact| / D`` with D:

- all-gather: the scale s of the element's block in its owner's slice;
- reduce-scatter: the sum over ranks of the scale s_r of the block holding the element in what
  rank r quantized (its slice; with two levels its super-slice), and with two levels, for every
  node, T = the largest sum over the node's ranks of s_r within the element's block of the slice
  that crosses (the node's partial sum is re-quantized; |partial| <= qmax x that sum).

Per element, rounding to nearest gives |x - q s| <= s/2: an all-gather's error is <= D/2, a flat
reduce-scatter's <= sum_r s_r / 2, a two-level one's <= sum_r s_r / 2 + sum_nodes t / 2 with t <= T.
The float32 arithmetic adds to that, to first order: the division x / s (at most qmax ulps of
x / s), the product q x s (half an ulp of a value <= qmax s), the float32 sum of N rows in rank
order (N - 1 roundings of a partial sum <= qmax x the scales summed so far), and the cast to the
storage dtype, at each level (half an ulp of the dtype of a value <= qmax D). So

    |result - exact| <= BETA x D + (N + 1) x the dtype's smallest subnormal,
    BETA = 1/2 + (qmax + 1) x ((N + 3) u32 + 2 u),   u32 = 2^-24, u = eps(dtype) / 2,

0.5000... for fp32 (int8 at N = 4: 0.50005), and 0.5 + 128/1024 = 0.625 with int8 on fp16 (where
half an ulp of fp16 at qmax s is 0.062 s). An element beyond it is counted wrong (NaN too).
"""
from typing import Optional, Tuple

import numpy as np

from .cases import TYPE_NAMES, Case, fill, oracle_sum, rank_values
from ..comm.quantized import Quantization, QuantizedGather
from ..optim.reference import QMAX, quantize_reference


def beta(n: int, bits: int, dtype) -> float:
    """BETA: the bound on |result - exact| / D for n ranks (1 for the all-gather) and the storage dtype."""
    u = float(np.finfo(dtype).eps) / 2
    return 0.5 + (float(QMAX[bits]) + 1) * ((n + 3) * 2.0 ** -24 + 2 * u)


def slack(n: int, dtype) -> float:
    """The absolute part of the bound: rounding in the dtype's subnormal range."""
    return (n + 1) * float(np.finfo(dtype).smallest_subnormal)


def rank_input(rank: int, lo: int, hi: int, dtype) -> np.ndarray:
    """Rank's input elements lo..hi-1 as the buffer holds them (rounded to dtype)."""
    return rank_values(rank, lo, hi).astype(dtype)


def block_scales(x: np.ndarray, bits: int, block: int) -> np.ndarray:
    """The float32 scale of every element's block when ``x`` is quantized from its start (float64)."""
    _, scales = quantize_reference(x, bits, block)
    return np.repeat(scales.astype(np.float64), block)[:x.size]


def reduce_scatter_scales(dtype, n: int, q: Quantization, slot: int, k: int,
                          nodes: Optional[Tuple[int, int]] = None) -> np.ndarray:
    """D for the k elements of slice ``slot`` of a reduce-scatter over n ranks (module docstring).

    ``nodes``: (K ranks per node, M nodes) of the two-level form, whose slot l * M + m lies in the
    super-slice l (M slices) that the node level quantizes; None: the flat form, which quantizes slices.
    """
    lo = slot * k
    if nodes is None:
        return sum(block_scales(rank_input(r, lo, lo + k, dtype), q.bits, q.block) for r in range(n))
    kk, m = nodes
    top = slot // m * m * k                         # where the super-slice starts
    per_node = np.zeros((n // kk, k))
    for r in range(n):                              # rank r sits on node r // K
        scales = block_scales(rank_input(r, top, top + m * k, dtype), q.bits, q.block)
        per_node[r // kk] += scales[lo - top:lo - top + k]
    nb = -(-k // q.block)
    blocks = np.zeros((n // kk, nb * q.block))
    blocks[:, :k] = per_node
    crossing = np.repeat(blocks.reshape(n // kk, nb, q.block).max(axis=2), q.block, axis=1)[:, :k]
    return per_node.sum(axis=0) + crossing.sum(axis=0)


def errors(got: np.ndarray, exact: np.ndarray, scales: np.ndarray, bound: float, tiny: float):
    """(wrong elements, max, sum of squares, count) of |got - exact| / scales: wrong beyond
    ``bound`` x scales + ``tiny`` or NaN; an error where the scale is 0 counts as infinite."""
    err = np.abs(got.astype(np.float64) - exact)
    wrong = int(np.count_nonzero(~(err <= bound * scales + tiny)))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(scales > 0, err / np.where(scales > 0, scales, 1), np.where(err == 0, 0.0, np.inf))
    ratio[np.isnan(ratio)] = np.inf
    return wrong, float(ratio.max(initial=0.0)), float(np.square(ratio).sum()), int(ratio.size)


def make_quant_case(op: str, comm, buf: np.ndarray, out: np.ndarray, dtype_name: str, quant: Quantization,
                    xp=np) -> Case:
    """The quantized ``op`` (reduce_scatter or all_gather) over ``comm`` (flat, staged or two-level)
    on ``buf`` (the whole buffer) and ``out`` (one slice): a Case whose verify() also leaves the
    error (max, sum of squares, count) for ``error()``."""
    n, me, slot = comm.size, comm.rank, comm.slot
    owner = {s: r for r, s in enumerate(comm.slots)}               # slice -> rank
    levels = getattr(comm, "host", comm)                           # a staged one's host does the levels
    nodes = (levels.k, levels.m) if getattr(levels, "hierarchical", False) else None
    k = buf.size // n
    dtype = buf.dtype
    pristine = np.empty_like(buf)
    fill(pristine, me)
    wire, wout, host = buf, out, np.asarray
    if xp is not np:
        wire, wout, pristine, host = xp.asarray(wire), xp.asarray(wout), xp.asarray(pristine), xp.asnumpy
    last = {}

    if op == "reduce_scatter":
        bound = beta(n, quant.bits, dtype)

        def reset():
            wire[...] = pristine

        def poison():
            wout[...] = np.nan

        def verify():
            exact, _ = oracle_sum(dtype, n, slot * k, (slot + 1) * k)
            scales = reduce_scatter_scales(dtype, n, quant, slot, k, nodes)
            wrong, *last["stats"] = errors(host(wout), exact, scales, bound, slack(n, dtype))
            return wrong
        run = lambda: comm.reduce_scatter(wire, wout, quant=quant)
        start = lambda: comm.ireduce_scatter(wire, wout, quant=quant)
    elif op == "all_gather":
        bound = beta(1, quant.bits, dtype)
        gather = QuantizedGather(comm, quant)

        def reset():      # the own slice too: every slice comes back dequantized
            wire[slot * k:(slot + 1) * k] = pristine[slot * k:(slot + 1) * k]

        def poison():
            wire[:slot * k] = np.nan
            wire[(slot + 1) * k:] = np.nan

        def verify():
            inputs = [rank_input(owner[s], s * k, (s + 1) * k, dtype) for s in range(n)]
            scales = np.concatenate([block_scales(x, quant.bits, quant.block) for x in inputs])
            exact = np.concatenate(inputs).astype(np.float64)
            wrong, *last["stats"] = errors(host(wire), exact, scales, bound, slack(1, dtype))
            return wrong
        run, start = (lambda: gather.all_gather(wire)), (lambda: gather.iall_gather(wire))
    else:
        raise ValueError(f"op={op!r} has no quantized form")
    return Case(run, start, reset, poison, verify, TYPE_NAMES[dtype_name], buf.size,
                wire_bytes=n * quant.wire_bytes(k), error=lambda: tuple(last["stats"]), bound=bound)


# ---- printing ----------------------------------------------------------------------------------
HEADER = (f" {'wire':>10} {'err_max':>7} {'err_rms':>7}", f" {'(B)':>10} {'(/scale)':>7} {'':>7}")
"""The table's extra columns in a run with quantized rows: the buffer's wire bytes and the error."""


def columns(rec: dict) -> str:
    """The wire bytes (the size for an unquantized row) and, with --check, the quantization error."""
    err = lambda v: "-" if v is None else f"{v:.3f}"
    return f" {rec['wire_bytes']:>10} {err(rec['quant_err_max']):>7} {err(rec['quant_err_rms']):>7}"


def banner(block: int) -> str:
    return (f"# quantized rows (-q8, -q4): int8 / int4 blocks of {block} elements with a float32 scale each "
            f"(comm/quantized.py); size, algbw and busbw count the logical bytes (the buffer unquantized), "
            f"wire the bytes it travels as; err: |result - exact| / scale (bench/quantized.py), max and RMS")


def footer(records) -> list:
    """Per quantized implementation and op: the wire bytes over the logical ones, and the error."""
    lines = []
    for impl, op in dict.fromkeys((r["impl"], r["op"]) for r in records if r["quant"]):
        mine = [r for r in records if (r["impl"], r["op"]) == (impl, op)]
        ratio = sum(r["wire_bytes"] for r in mine) / sum(r["bytes"] for r in mine)
        line = f"# {impl} {op}: wire {ratio:.3f} of the logical bytes"
        if mine[0]["quant_err_max"] is not None:
            line += (f"; error / scale: max {max(r['quant_err_max'] for r in mine):.3f}, RMS "
                     f"{max(r['quant_err_rms'] for r in mine):.3f} (the largest over sizes; bound "
                     f"{mine[0]['quant_err_bound']:.6f})")
        lines.append(line)
    return lines
