"""The options of ``python -m zerompi.bench``: BenchConfig, its checks and the command line.

One concern: turning flags into a validated, frozen BenchConfig that every rank builds alike
(bad input: ConfigError with one line naming the value and what is allowed). What the rows
measure is run.py's and cases.py's.
"""
import argparse
import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

from .levels import TWO_LEVEL
from ..comm.quantized import DEFAULT_BLOCK, check_quantization
from ..errors import ConfigError, RankParser, check
from ..optim.impl import OPTIMIZER_IMPLS

OPS = ("reduce_scatter", "all_gather", "all_reduce")
SP_OPS = ("all_to_all",)                                      # --sp: sequence parallelism's exchange (sp_alltoall.py)
EP_OPS = ("all_to_allv",)                                     # --ep: expert parallelism's exchange (ep_alltoallv.py)
# --tp and --sp: (the group, its one collective, what it does, why it is not quantized, the Mesh's call)
GROUPS = {"tp": ("tensor-parallel", "all_reduce", "all-reduces", "the engine never quantizes an all-reduce",
                 "TP all-reduce"),
          "sp": ("sequence-parallel", "all_to_all", "exchanges all-to-all", "the all-to-all travels unquantized",
                 "SP all-to-all"),
          "ep": ("expert-parallel", "all_to_allv", "exchanges tokens all-to-all(v)",
                 "the all-to-all(v) travels unquantized", "EP all-to-all(v)")}
GROUP_IMPLS = {"tp": "zerompi-tp", "sp": "zerompi-sp", "ep": "zerompi-ep"}   # zerompi's rows over each group
DTYPES = {"fp16": np.float16, "fp32": np.float32}
IMPLS = ("zerompi", "mpi")                                   # --impl both
# ZeRO++'s quantized collectives: bits (bench/quantized.py)
QUANTIZED = {"zerompi-q8": 8, "zerompi-q4": 4}
ALL_IMPLS = ("zerompi", *QUANTIZED, "mpi")
QUANTIZED_OPS = ("reduce_scatter", "all_gather")              # the engine never quantizes an all-reduce
IMPL_CHOICES = f"{', '.join(ALL_IMPLS)}, both, or a comma-separated list of them"
DEVICES = ("cpu", "gpu")
COMMS = ("mpi", "nccl")
SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
MAX_SIZES = 1000     # sizes one run may measure: -b, -e and -f must not ask for more


def quant_bits(impl: str) -> Optional[int]:
    """8 or 4 for the rows of a quantized implementation (flat or two-level), else None."""
    return QUANTIZED.get(impl.replace(TWO_LEVEL, "zerompi", 1))


def two_level(impl: str) -> str:
    """The two-level implementation of a flat zerompi one: zerompi-q8 -> zerompi-2level-q8."""
    return TWO_LEVEL + impl[len("zerompi"):]


def parse_size(text: str) -> int:
    """'8K' -> 8192, '64M' -> 67108864, '1G', '4096' (binary suffixes; bytes)."""
    t = str(text).strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in SUFFIXES else ""
    try:
        value = float(t[:len(t) - len(unit)]) * SUFFIXES[unit]
    except ValueError:
        raise ConfigError(f"size {text!r} is not a byte count; use e.g. 4096, 8K, 64M or 1G")
    check(math.isfinite(value) and value >= 1 and value == int(value),
          f"size {text!r} must be a whole number of bytes >= 1")
    return int(value)


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run; every rank builds the same one from the same flags."""

    ops: Tuple[str, ...] = OPS
    """Collectives to time, in this order."""
    min_bytes: int = 1 << 20
    """Smallest buffer, bytes of the whole buffer (N slices)."""
    max_bytes: int = 64 << 20
    """Largest buffer, bytes."""
    factor: float = 2.0
    """Each size is the previous one times this (> 1)."""
    dtype: str = "fp32"
    """Element type: fp16 or fp32."""
    iters: int = 20
    """Timed iterations per row (the median is reported)."""
    warmup: int = 3
    """Untimed iterations before them (first-touch page faults, connection set-up)."""
    impls: Tuple[str, ...] = IMPLS
    """Of ALL_IMPLS, side by side in this order: zerompi, mpi, and the quantized zerompi-q8, zerompi-q4."""
    device: str = "cpu"
    """Where the buffers live: cpu (NumPy) or gpu (CuPy)."""
    comm: str = "mpi"
    """gpu: how the zerompi rows move device buffers: mpi (staged through pinned host buffers) or nccl."""
    check: bool = False
    """Count wrong elements against a float64 oracle."""
    overlap: bool = True
    """Measure non-blocking overlap (OSU method)."""
    json_path: Optional[str] = None
    """Write the records as a JSON list here (rank 0)."""
    plot_path: Optional[str] = None
    """Draw busbw against size here, an image (rank 0; bench/plot.py, needs matplotlib)."""
    sum_impl: str = "auto"
    """zerompi's local reduce-scatter sum: auto (fused C when it builds), fused, or numpy (impl.use_impl)."""
    local_sum: Optional[str] = None
    """What sum_impl resolved to ("fused" or "numpy"), once impl.use_impl has run."""
    node_size: Optional[int] = None
    """Simulate nodes of this many consecutive ranks: adds the two-level rows (zerompi-2level) and
    the bytes of one call inside and across nodes (bench/levels.py)."""
    quant_block: int = DEFAULT_BLOCK
    """Elements per quantization block of the quantized rows (a power of two >= 8), as --quant-block."""
    tp: Optional[int] = None
    """Measure the all-reduce over tensor-parallel groups of this many adjacent ranks instead
    (zerompi.Mesh's TP all-reduce, impl zerompi-tp, beside MPI's Allreduce on the group; bench/tp_allreduce.py)."""
    sp: Optional[int] = None
    """Measure the all-to-all over sequence-parallel groups of this many adjacent ranks instead (zerompi.Mesh's
    SP all-to-all as attention calls it, impl zerompi-sp, beside MPI's Alltoall on the group; bench/sp_alltoall.py)."""
    ep: Optional[int] = None
    """Measure the all-to-all(v) over expert-parallel groups of this many adjacent ranks instead, balanced and skewed
    counts (comm/ep_alltoall.py's exchange, impl zerompi-ep, beside MPI's Alltoallv; bench/ep_alltoallv.py)."""

    def __post_init__(self):
        for op in self.ops:
            check(op in OPS + SP_OPS + EP_OPS,
                  f"op={op!r} is not allowed; use one of {', '.join(OPS + SP_OPS + EP_OPS)} or all")
            check(op not in SP_OPS or self.sp is not None, f"op={op} needs --sp K: it is the exchange of "
                                                           "sequence-parallel groups of K ranks")
            check(op not in EP_OPS or self.ep is not None, f"op={op} needs --ep K: it is the exchange of "
                                                           "expert-parallel groups of K ranks")
        check(self.dtype in DTYPES, f"dtype={self.dtype!r} is not allowed; use fp16 or fp32")
        for impl in self.impls:
            check(impl in ALL_IMPLS, f"impl={impl!r} is not allowed; use {IMPL_CHOICES}")
        check(len(set(self.impls)) == len(self.impls) > 0, f"impl={','.join(self.impls)!r} names an implementation "
                                                          "twice or none; name each one once")
        check_quantization(block=self.quant_block)
        quantized = [i for i in self.impls if i in QUANTIZED]
        check(not quantized or self.comm == "mpi", f"impl={quantized[0] if quantized else ''!r} needs --comm mpi: "
                                                   "NCCL's path does not offer quantization")
        check(self.device in DEVICES, f"device={self.device!r} is not allowed; use cpu or gpu")
        check(self.comm in COMMS, f"comm={self.comm!r} is not allowed; use {' or '.join(COMMS)}")
        check(self.comm == "mpi" or self.device == "gpu",
              f"comm={self.comm!r} needs --device gpu (NCCL moves GPU memory); use --comm mpi on the CPU")
        check(self.min_bytes >= 1, f"min size={self.min_bytes} must be >= 1 byte")
        check(self.min_bytes <= self.max_bytes,
              f"min size={self.min_bytes} bytes is larger than max size={self.max_bytes} bytes; use -b <= -e")
        check(math.isfinite(self.factor) and self.factor > 1, f"factor={self.factor:g} must be a finite number > 1")
        count = math.floor(math.log(self.max_bytes / self.min_bytes) / math.log(self.factor)) + 1
        check(count <= MAX_SIZES, f"factor={self.factor!r} makes {count:,} sizes from {self.min_bytes} to "
                                  f"{self.max_bytes} bytes; at most {MAX_SIZES} are allowed (use a larger -f)")
        check(self.iters >= 1, f"iters={self.iters} must be >= 1")
        check(self.warmup >= 0, f"warmup={self.warmup} must be >= 0")
        check(self.node_size is None or (isinstance(self.node_size, int) and self.node_size >= 1),
              f"node_size={self.node_size!r} must be a whole number of ranks >= 1")
        check(self.tp is None or self.sp is None, f"sp={self.sp} and tp={self.tp} measure different tables "
                                                  "(the all-to-all, the all-reduce); give one of --sp and --tp")
        other = "tp" if self.tp is not None else "sp"
        check(self.ep is None or (self.tp is None and self.sp is None),
              f"ep={self.ep} and {other}={getattr(self, other)} measure different tables; give one of --ep and "
              f"--{other}")
        for name in ("tp", "sp", "ep"):
            if getattr(self, name) is not None:
                self._check_group(name)
        check(self.sum_impl in OPTIMIZER_IMPLS,
              f"sum_impl={self.sum_impl!r} is not allowed; use one of {', '.join(OPTIMIZER_IMPLS)}")

    def _check_group(self, name: str) -> None:
        """With --tp or --sp: a group of 2 ranks or more, its one collective alone, unquantized, on the CPU, flat."""
        kind, op, does, unquantized, what = GROUPS[name]
        k = getattr(self, name)
        check(isinstance(k, int) and not isinstance(k, bool) and k >= 1,
              f"{name}={k!r} must be a whole number of ranks >= 2")
        check(k >= 2, f"{name}={k} makes groups of one rank: there is no {op.replace('_', '-')} to measure; use a "
                      "group of 2 ranks or more")
        other = [o for o in self.ops if o != op]
        check(not other, f"op={other[0] if other else ''} has no --{name} rows: a {kind} group only {does}; use "
                         f"--op {op} (or leave --op out)")
        quantized = [i for i in self.impls if i in QUANTIZED]
        check(not quantized, f"impl={quantized[0] if quantized else ''} has no --{name} rows: {unquantized}; use "
                             "--impl zerompi, mpi or both")
        check(self.node_size is None, f"{name}={k} and node_size={self.node_size} measure different tables; "
                                      f"give one of --{name} and --node-size")
        check(self.device == "cpu", f"{name}={k} needs --device cpu: the Mesh's {what} runs on host buffers")

    def row_impls(self) -> Tuple[str, ...]:
        """The implementations of the rows. With node_size, the two-level ones: zerompi-2level beside
        zerompi's flat one (first when zerompi is not asked for), zerompi-2level-q8 beside zerompi-q8 ...
        With tp, zerompi's rows are the Mesh's TP all-reduce (bench/tp_allreduce.py): zerompi-tp."""
        group = self.group
        if group is not None:
            return tuple(GROUP_IMPLS[group] if i == "zerompi" else i for i in self.impls)
        if self.node_size is None:
            return self.impls
        out = [] if "zerompi" in self.impls else [TWO_LEVEL]
        for impl in self.impls:
            out += [impl, two_level(impl)] if impl != "mpi" else [impl]
        return tuple(out)

    def op_impls(self, op: str) -> Tuple[str, ...]:
        """The row implementations of ``op``: the quantized ones have no all-reduce (nor does the engine)."""
        return tuple(i for i in self.row_impls() if op in QUANTIZED_OPS or quant_bits(i) is None)

    @property
    def group(self) -> Optional[str]:
        """"tp", "sp" or "ep": the model-parallel group whose one collective the rows measure (None: ZeRO's)."""
        return next((name for name in GROUPS if getattr(self, name) is not None), None)

    @property
    def quantized(self) -> bool:
        return any(i in QUANTIZED for i in self.impls)

    def sizes(self) -> List[int]:
        """min, min*f, min*f^2, ... <= max (bytes, before padding to whole slices)."""
        out, s = [], float(self.min_bytes)
        while s <= self.max_bytes:
            if not out or int(s) != out[-1]:
                out.append(int(s))
            s *= self.factor
        return out


def build_parser() -> argparse.ArgumentParser:
    p = RankParser(prog="python -m zerompi.bench", description="Collectives microbenchmark (see the module docstring).")
    p.add_argument("--op", default="all", help=f"{' | '.join(OPS)} | all")
    p.add_argument("-b", "--minbytes", default="1M", help="smallest buffer, bytes (suffixes K, M, G)")
    p.add_argument("-e", "--maxbytes", default="64M", help="largest buffer, bytes")
    p.add_argument("-f", "--stepfactor", default="2", help="size multiplication factor (> 1)")
    p.add_argument("--dtype", default=BenchConfig.dtype, help="fp16 or fp32")
    p.add_argument("--iters", type=int, default=BenchConfig.iters, help="timed iterations (median reported)")
    p.add_argument("--warmup", type=int, default=BenchConfig.warmup, help="untimed iterations first")
    p.add_argument("--impl", default="both", help=f"{' | '.join(ALL_IMPLS)} | both, or a comma-separated list "
                                                  "(e.g. zerompi,zerompi-q8,zerompi-q4,mpi)")
    p.add_argument("--quant-block", type=int, default=None, metavar="B",
                   help="elements per scale in the quantized rows (a power of two >= 8)")
    p.add_argument("--device", default=BenchConfig.device, help="cpu or gpu")
    p.add_argument("--comm", default=BenchConfig.comm, help="with --device gpu: mpi (staged) or nccl")
    p.add_argument("--check", action="store_true", help="count wrong elements against a float64 oracle")
    p.add_argument("--no-overlap", action="store_true", help="skip the non-blocking overlap measurement")
    p.add_argument("--json", default=None, metavar="PATH", help="write the records as a JSON list")
    p.add_argument("--plot", default=None, metavar="PNG", help="draw busbw against size (needs matplotlib)")
    p.add_argument("--sum-impl", default=BenchConfig.sum_impl,
                   help=f"zerompi's local sum: {' | '.join(OPTIMIZER_IMPLS)}")
    p.add_argument("--node-size", type=int, default=None, metavar="K",
                   help="simulate nodes of K consecutive ranks: add the two-level rows (zerompi-2level) and the "
                        "bytes of one call inside and across nodes")
    p.add_argument("--tp", type=int, default=None, metavar="K",
                   help="the all-reduce over tensor-parallel groups of K adjacent ranks (zerompi.Mesh): the "
                        "Mesh's TP all-reduce (zerompi-tp) beside MPI's Allreduce on the same group")
    p.add_argument("--sp", type=int, default=None, metavar="K",
                   help="the all-to-all over sequence-parallel groups of K adjacent ranks (zerompi.Mesh): the "
                        "Mesh's SP all-to-all as attention calls it (zerompi-sp) beside MPI's Alltoall on the group")
    p.add_argument("--ep", type=int, default=None, metavar="K",
                   help="the all-to-all(v) over expert-parallel groups of K adjacent ranks, balanced and skewed "
                        "counts: the MoE's exchange (zerompi-ep: counts, then rows) beside MPI's Alltoallv")
    return p


def parse_config(argv: Optional[List[str]] = None) -> BenchConfig:
    """CLI flags -> BenchConfig (raises ConfigError on bad input)."""
    a = build_parser().parse_args(argv)
    try:
        factor = float(a.stepfactor)
    except ValueError:
        raise ConfigError(f"factor={a.stepfactor!r} is not a number; use e.g. 2")
    check(a.op == "all" or a.op in OPS + SP_OPS + EP_OPS,
          f"op={a.op!r} is not allowed; use one of {', '.join(OPS + SP_OPS + EP_OPS)} or all")
    impls = IMPLS if a.impl == "both" else tuple(a.impl.split(","))
    for impl in impls:
        check(impl in ALL_IMPLS, f"impl={impl!r} is not allowed; use {IMPL_CHOICES}")
    quantized = [i for i in impls if i in QUANTIZED]
    check(a.quant_block is None or quantized, f"quant_block={a.quant_block} applies to the quantized rows only; "
          f"add zerompi-q8 or zerompi-q4 to --impl, or drop --quant-block")
    check(a.op != "all_reduce" or not quantized, f"op=all_reduce has no {quantized[0] if quantized else ''} rows: "
          f"the engine never quantizes an all-reduce; use --op {' or '.join(QUANTIZED_OPS)} (or all: the "
          f"quantized implementations then skip the all-reduce)")
    ops = OPS if a.op == "all" else (a.op,)
    ops = ("all_reduce",) if a.tp is not None and a.op == "all" else ops     # --tp: the all-reduce alone
    ops = SP_OPS if a.sp is not None and a.op == "all" else ops              # --sp: the all-to-all alone
    ops = EP_OPS if a.ep is not None and a.op == "all" else ops              # --ep: the all-to-all(v) alone
    cfg = BenchConfig(ops=ops, min_bytes=parse_size(a.minbytes),
                      max_bytes=parse_size(a.maxbytes), factor=factor, dtype=a.dtype, iters=a.iters,
                      warmup=a.warmup, impls=impls, device=a.device, comm=a.comm,
                      check=a.check, overlap=not a.no_overlap, json_path=a.json, sum_impl=a.sum_impl,
                      node_size=a.node_size, quant_block=DEFAULT_BLOCK if a.quant_block is None else a.quant_block,
                      plot_path=a.plot, tp=a.tp, sp=a.sp, ep=a.ep)
    return cfg
