"""ZeroConfig: every knob of the engine, validated once, frozen."""
import difflib
import functools
import math
import os
from dataclasses import asdict, dataclass, fields
from typing import Callable, Optional, Tuple

import numpy as np

from ..comm.quantized import DEFAULT_BLOCK, check_quantization
from ..errors import ConfigError, check
from ..optim.impl import OPTIMIZER_IMPLS

STAGES = (0, 1, 2, 3)
DTYPES = ("fp16", "fp32", "bf16")
PROGRESS = ("test", "thread")
INIT_VALUES = ("check", "broadcast")
F32_MAX = float(np.finfo(np.float32).max)   # 3.4028235e+38: the optimizer's numbers are float32

# The float fields: what each must be, and whether it enters the optimizer's float32 arithmetic
# (then its float32 value must be finite and obey the rule too: lr=1e39 is inf there, beta2=1-1e-9 is 1).
FLOAT_RULES = {
    "bucket_mb": ("> 0 (MiB per bucket)", lambda v: v > 0, False),
    "lr": ("> 0", lambda v: v > 0, True),
    "beta1": ("in [0, 1)", lambda v: 0 <= v < 1, True),
    "beta2": ("in [0, 1)", lambda v: 0 <= v < 1, True),
    "eps": ("> 0", lambda v: v > 0, True),
    "weight_decay": (">= 0", lambda v: v >= 0, True),
    "clip": (">= 0 (0 = off)", lambda v: v >= 0, True),
    "init_loss_scale": ("> 0", lambda v: v > 0, True),
    "min_loss_scale": ("> 0", lambda v: v > 0, True),
}


def check_float(name: str, value, rule: str, ok: Callable[[float], bool], float32: bool) -> None:
    """ConfigError naming ``name=value`` unless value is a finite real number for which ``ok`` holds,
    and, with ``float32``, so does its float32 value (at most F32_MAX in magnitude, not rounded to 0 or 1)."""
    real = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not real or not math.isfinite(value):
        raise ConfigError(f"{name}={value!r} is not allowed; use a finite number {rule}")
    check(ok(value), f"{name}={value!r} must be {rule}")
    if float32:
        with np.errstate(over="ignore"):
            stored = float(np.float32(value))
        check(math.isfinite(stored) and ok(stored),
              f"{name}={value!r} is {stored!r} in float32, the precision of the optimizer's arithmetic; "
              f"use a number {rule} that float32 holds (magnitude at most {F32_MAX:.8g})")


class UnknownFieldError(ConfigError, TypeError):
    """A ZeroConfig field that does not exist (a TypeError, as Python's own, and one ConfigError line)."""


# What each field's declared type admits (ZeroConfig's docstring): NumPy scalars are taken as Python's.
KINDS = {int: "int", Optional[int]: "int", float: "float", Optional[float]: "float", bool: "bool"}


def strict_value(name: str, kind: str, value):
    """``value`` of a field of kind "int", "float" or "bool" as ZeroConfig keeps it: a NumPy scalar as the
    Python int, float or bool it equals; ConfigError for a bool in a number's field or a float in an int's.
    Other types pass (the field's own check names what it allows)."""
    if kind == "bool":
        if isinstance(value, np.bool_):
            return bool(value)
        check(isinstance(value, bool), f"{name}={value!r} must be True or False (a bool, not {type(value).__name__})")
        return value
    if isinstance(value, (bool, np.bool_)):
        wanted = "whole number (an int)" if kind == "int" else "number"
        raise ConfigError(f"{name}={value!r} is a bool; give a {wanted}")
    if isinstance(value, np.integer):
        return int(value)
    if kind == "int" and isinstance(value, (float, np.floating)):
        whole = f": {int(value)}" if float(value).is_integer() else ""
        raise ConfigError(f"{name}={value!r} is a float; give a whole number (an int{whole})")
    return float(value) if isinstance(value, np.floating) else value


@dataclass(frozen=True)
class ZeroConfig:
    """Engine configuration. Units are in each field's docstring; invalid values raise ConfigError.

    Types, one rule for every field (checked before the values): an int field (``stage``,
    ``micro_batches``, ``node_size``, ...) takes an int or a NumPy integer, never a bool or a float
    (``stage=3.0`` and ``stage=True`` are refused); a float field (``lr``, ``bucket_mb``, ...) takes
    an int, a float or a NumPy integer or float (``lr=np.float32(1e-3)`` is kept as the Python float
    it equals), never a bool; a bool field takes a bool or a NumPy bool, never 0 or 1. NumPy scalars
    are stored as Python's, so the config, its JSON and its digest are the same whichever was given.
    A field that does not exist is an UnknownFieldError (a ConfigError and a TypeError) naming it.
    """

    stage: int = 2
    """ZeRO stage: 0 (plain data parallel), 1 (shard optimizer state), 2 (+ gradients), 3 (+ parameters)."""
    dtype: str = "fp16"
    """Storage dtype of parameters and gradients: "fp16" (with dynamic loss scaling), "bf16" (bfloat16:
    float32's range, no loss scaling; NumPy's bfloat16 comes from the ml_dtypes package) or "fp32"."""
    bucket_mb: float = 25.0
    """Target bucket size in MiB of the storage dtype; buckets are cut at layer boundaries."""
    lr: float = 1e-3
    """AdamW learning rate (> 0)."""
    beta1: float = 0.9
    """AdamW first-moment decay, in [0, 1)."""
    beta2: float = 0.999
    """AdamW second-moment decay, in [0, 1)."""
    eps: float = 1e-8
    """AdamW denominator epsilon (> 0)."""
    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay, >= 0; applied to every parameter but those ``no_decay`` names."""
    no_decay: Tuple[str, ...] = ()
    """Parameters exempt from weight decay, by shell-style patterns on their names (``"*.bias"``,
    ``"ln_f.*"``, ``"wte"``: fnmatch, case-sensitive); a pattern matching no parameter is an error
    when the engine starts. Groups follow names, so they survive resharding (engine/decay.py)."""
    clip: float = 0.0
    """Clip gradients to this global L2 norm; 0 turns clipping off."""
    micro_batches: int = 1
    """Micro-batches accumulated per optimizer step (>= 1); gradients are reduced per micro-batch."""
    init_loss_scale: float = 2.0 ** 16
    """fp16: starting loss scale (a power of two is exact)."""
    loss_scale_window: int = 1000
    """fp16: double the loss scale after this many consecutive steps without overflow."""
    min_loss_scale: float = 1.0
    """fp16: the loss scale never drops below this."""
    optimizer_impl: str = "auto"
    """AdamW step and gradient pre-pass: "fused" (one-pass kernels: C on the CPU, CUDA on CuPy),
    "numpy" (the reference), or "auto" (fused when its kernels build or load, else numpy)."""
    align: int = 16
    """Each bucket slice is a multiple of this many elements (16 -> 32-byte fp16 slices)."""
    overlap: bool = True
    """Run collectives behind compute (non-blocking, waited for only when their data is read).
    False waits for every collective as soon as it starts: the serial baseline; prefetch is then unused."""
    prefetch: int = 1
    """Stage 3: buckets gathered ahead of the layer computing now, in visit order (0 = gather on demand).
    At most 1 + prefetch gathered buckets are alive at once (plus those of layers the caller still holds)."""
    progress: str = "test"
    """How in-flight collectives advance during compute: "test" (the engine tests them at every
    unshard, reshard and grads_ready) or "thread" (also a polling thread; needs MPI_THREAD_MULTIPLE)."""
    timeout_s: Optional[float] = None
    """Seconds one collective may wait before the watchdog aborts the job (> 0); only waiting counts,
    not compute. None = the environment variable ZEROMPI_TIMEOUT_S, else 300, read when the engine's
    watchdog starts (docs/failures.md); the train CLI reads it when the job starts."""
    max_skipped_steps: int = 50
    """fp16: this many consecutive steps skipped for non-finite gradients is an error (>= 1)."""
    lazy_publish: bool = False
    """Stages 1/2: return from step() while the new parameters' all-gathers are still in flight, each
    completed when its bucket is first read through params() or unshard() (they then run behind the
    next forward). A parameter view taken before step() holds old values until it is taken again, so
    only for code that reads parameters through params()/unshard() after every step, as the built-in
    models do. False (the default): step() returns with every parameter in place."""
    node_size: Optional[int] = None
    """Ranks per node: blocks of consecutive ranks that share the fast links. None: $ZEROMPI_NODE_SIZE,
    else MPI's shared-memory split. Setting it on one machine simulates several nodes (comm/topology.py)."""
    shard_size: Optional[int] = None
    """Ranks that share one sharded copy of the model states (MiCS / hybrid sharding): groups of this
    many consecutive ranks, whole nodes, each replicated across the N / shard_size groups. None: all N."""
    tp: int = 1
    """Tensor-parallel ranks per group (comm/mesh.py): N ranks form N/tp data-parallel groups x tp adjacent
    TP ranks, and the engine shards each TP rank's pieces over its data-parallel group (needs tp_split)."""
    sp: int = 1
    """Sequence-parallel ranks per group (DeepSpeed-Ulysses; comm/mesh.py): each sequence is cut into sp
    contiguous chunks, one per rank of the group, whose all-to-alls give attention the whole sequence for
    n_head / sp of the heads. Those ranks hold the same parameters: ZeRO shards over dp x sp ranks together."""
    pp: int = 1
    """Pipeline stages of the mesh (comm/mesh.py): N ranks = pp stages x N/(tp pp) data-parallel x tp. An engine
    holds one model chunk of one stage (give it the zerompi.Mesh); zerompi.pipeline runs the stages and decides
    each step over the whole mesh (docs/pipeline.md)."""
    hpz: bool = False
    """Stage 3, ZeRO++'s hpZ: keep a node-local secondary copy (1/node_size of the parameters per rank)
    after each gather across nodes, and gather from it inside the node until the next step."""
    quantize_weights: Optional[str] = None
    """ZeRO++ qwZ: None, or "int8": the parameter all-gathers (stage 3's, and stages 1/2's publish)
    send int8 blocks with a float32 scale each; the master stays exact (comm/quantized.py)."""
    quantize_grads: Optional[str] = None
    """ZeRO++ qgZ: None, "int8" or "int4": the gradient reduce-scatters send quantized blocks, summed
    in fp32 after dequantization (across nodes: each level re-quantizes its partial sum)."""
    quant_block: int = DEFAULT_BLOCK
    """Elements per quantization block (one float32 scale each): a power of two >= 8."""
    offload_optimizer: str = "none"
    """Where the fp32 master and Adam moments live (stages 1-3; engine/offload/): "none" (with the
    parameters), "cpu" (host memory; the update runs there; on the CPU device the normal path) or
    "nvme" (files under offload_dir, streamed bucket by bucket through a few host buffers)."""
    offload_params: str = "none"
    """Stage 3: "nvme" keeps the stored parameter shard in a file under offload_dir."""
    offload_delayed_update: bool = False
    """ZeRO-Offload's one-step delayed parameter update (offload_optimizer="cpu"): step k's update runs
    on the host in the background while step k + 1's forward and backward run, so the gradients of
    step k + 1 are taken at the parameters before update k (staleness one step; docs/offload.md)."""
    offload_delayed_warmup: int = 0
    """With offload_delayed_update: the first this many updates run in step() as without it (not
    stale); the delayed update starts after them (DeepSpeed's warm-up steps; docs/offload.md)."""
    offload_dir: Optional[str] = None
    """The folder of the offload files (needed by "nvme"; checked at start for room)."""
    offload_io: str = "direct"
    """How the optimizer's file is read and written: "direct" (O_DIRECT: the device moves the rows, no
    copy through the page cache; buffered where the filesystem refuses it, as tmpfs does) or "buffered"."""
    init_values: str = "check"
    """The initial parameter values: "check" (every rank must pass the same; a difference stops every
    rank, naming the parameter and the ranks) or "broadcast" (rank 0's values are used on every rank)."""
    abort_on_exception: bool = True
    """An uncaught exception on any rank ends every rank of the job (MPI Abort) instead of leaving the
    others waiting in a collective until timeout_s; False leaves sys.excepthook alone."""
    trace: Optional[str] = None
    """Record a timeline of every rank's compute and collectives and write it to this file at close(), as
    Chrome trace-event JSON (Perfetto, chrome://tracing; engine/trace.py). None (the default): off."""
    trace_steps: int = 20
    """With trace: the timeline keeps the last this many steps (>= 1) and the step in progress."""

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in KINDS and value is not None:
                object.__setattr__(self, f.name, strict_value(f.name, KINDS[f.type], value))
        check(self.stage in STAGES, f"stage={self.stage!r} is not allowed; use one of 0, 1, 2, 3")
        check(self.dtype in DTYPES, f"dtype={self.dtype!r} is not allowed; use fp16, bf16 or fp32")
        if isinstance(self.no_decay, list):            # lists (JSON, a user's literal) are taken as tuples
            object.__setattr__(self, "no_decay", tuple(self.no_decay))
        for name in ("trace", "offload_dir"):            # a pathlib.Path is a path too: kept as its text
            if isinstance(getattr(self, name), os.PathLike):
                object.__setattr__(self, name, os.fspath(getattr(self, name)))
        check(isinstance(self.no_decay, tuple) and all(isinstance(p, str) and p for p in self.no_decay),
              f"no_decay={self.no_decay!r} must be a tuple of parameter-name patterns (non-empty strings)")
        for name, (rule, ok, float32) in FLOAT_RULES.items():
            check_float(name, getattr(self, name), rule, ok, float32)
        decay = self.lr * self.weight_decay   # AdamW multiplies every parameter by 1 - lr x weight_decay per step
        check(decay <= 1, f"weight_decay={self.weight_decay!r} with lr={self.lr!r}: lr x weight_decay = {decay:g} "
                          "must be <= 1 (each step multiplies every parameter by 1 - lr x weight_decay)")
        check(isinstance(self.micro_batches, int) and self.micro_batches >= 1,
              f"micro_batches={self.micro_batches!r} must be an integer >= 1")
        check(isinstance(self.loss_scale_window, int) and self.loss_scale_window >= 1,
              f"loss_scale_window={self.loss_scale_window!r} must be an integer >= 1")
        check(self.min_loss_scale <= self.init_loss_scale,
              f"min_loss_scale={self.min_loss_scale!r} must be in (0, init_loss_scale]")
        check(self.optimizer_impl in OPTIMIZER_IMPLS, f"optimizer_impl={self.optimizer_impl!r} is not allowed; "
                                                      f"use one of {', '.join(OPTIMIZER_IMPLS)}")
        check(isinstance(self.align, int) and self.align >= 1, f"align={self.align!r} must be an integer >= 1")
        check(isinstance(self.overlap, bool), f"overlap={self.overlap!r} must be True or False")
        check(isinstance(self.prefetch, int) and not isinstance(self.prefetch, bool) and self.prefetch >= 0,
              f"prefetch={self.prefetch!r} must be an integer >= 0 (buckets gathered ahead; 0 = off)")
        check(self.progress in PROGRESS, f"progress={self.progress!r} is not allowed; use one of {', '.join(PROGRESS)}")
        t = self.timeout_s
        check(t is None or (isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < float("inf")),
              f"timeout_s={t!r} must be a finite number of seconds > 0 (how long one collective may wait)")
        check(isinstance(self.max_skipped_steps, int) and self.max_skipped_steps >= 1,
              f"max_skipped_steps={self.max_skipped_steps!r} must be an integer >= 1")
        for name in ("node_size", "shard_size"):
            v = getattr(self, name)
            check(v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1),
                  f"{name}={v!r} must be a whole number of ranks >= 1 (or None)")
        if self.node_size and self.shard_size:
            check(self.shard_size % self.node_size == 0,
                  f"shard_size={self.shard_size} is not a multiple of node_size={self.node_size}; shard groups are "
                  "whole nodes")
        check(isinstance(self.tp, int) and not isinstance(self.tp, bool) and self.tp >= 1,
              f"tp={self.tp!r} must be a whole number of ranks >= 1 (tensor-parallel group size)")
        check(isinstance(self.sp, int) and not isinstance(self.sp, bool) and self.sp >= 1,
              f"sp={self.sp!r} must be a whole number of ranks >= 1 (sequence-parallel group size)")
        check(isinstance(self.pp, int) and not isinstance(self.pp, bool) and self.pp >= 1,
              f"pp={self.pp!r} must be a whole number of pipeline stages >= 1")
        check(isinstance(self.hpz, bool), f"hpz={self.hpz!r} must be True or False")
        check(not self.hpz or self.stage == 3, f"hpz=True needs stage 3 (stage={self.stage}): it keeps a "
                                               "node-local copy of the parameters stage 3 shards")
        check_quantization(self.quantize_weights, self.quantize_grads, self.quant_block)
        check(self.quantize_weights is None or self.stage > 0, f"quantize_weights={self.quantize_weights!r} needs "
              f"stage 1, 2 or 3 (stage={self.stage} all-gathers no parameters)")
        check(self.offload_optimizer in ("none", "cpu", "nvme"), f"offload_optimizer={self.offload_optimizer!r} "
                                                                  "is not allowed; use none, cpu or nvme")
        check(self.offload_params in ("none", "nvme"), f"offload_params={self.offload_params!r} is not allowed; "
                                                       "use none or nvme")
        check(self.offload_optimizer == "none" or self.stage > 0, f"offload_optimizer={self.offload_optimizer!r} "
              "needs stage 1, 2 or 3 (stage 0 keeps the whole state on every rank)")
        check(self.offload_params == "none" or self.stage == 3, f"offload_params={self.offload_params!r} needs "
              f"stage 3 (stage={self.stage} keeps every parameter on every rank)")
        check(isinstance(self.offload_delayed_update, bool) and (not self.offload_delayed_update
                                                                 or self.offload_optimizer == "cpu"),
              f"offload_delayed_update={self.offload_delayed_update!r} needs offload_optimizer='cpu' (the update runs "
              "on the host while the device computes the next step)")
        check(self.offload_io in ("direct", "buffered"), f"offload_io={self.offload_io!r} is not allowed; use "
                                                         "direct or buffered")
        w = self.offload_delayed_warmup
        check(isinstance(w, int) and not isinstance(w, bool) and w >= 0,
              f"offload_delayed_warmup={w!r} must be a whole number of steps >= 0")
        check(w == 0 or self.offload_delayed_update, f"offload_delayed_warmup={w!r} applies with the delayed "
              "update only (offload_delayed_update=True, --offload-delayed-update); drop it")
        nvme = "nvme" in (self.offload_optimizer, self.offload_params)
        check(not nvme or bool(self.offload_dir), "offload to nvme needs offload_dir (--offload-dir DIR): a "
                                                  "folder for the state files")
        check(self.offload_dir is None or isinstance(self.offload_dir, str) and self.offload_dir != "",
              f"offload_dir={self.offload_dir!r} must be a folder's path")
        check(isinstance(self.lazy_publish, bool), f"lazy_publish={self.lazy_publish!r} must be True or False")
        check(self.init_values in INIT_VALUES, f"init_values={self.init_values!r} is not allowed; "
                                               f"use one of {', '.join(INIT_VALUES)}")
        check(isinstance(self.abort_on_exception, bool), f"abort_on_exception={self.abort_on_exception!r} "
                                                         "must be True or False")
        check(self.trace is None or (isinstance(self.trace, str) and self.trace != ""),
              f"trace={self.trace!r} is not allowed; use a file path, or None for no trace")
        check(isinstance(self.trace_steps, int) and not isinstance(self.trace_steps, bool) and self.trace_steps >= 1,
              f"trace_steps={self.trace_steps!r} must be an integer >= 1 (the steps the trace keeps)")

    @property
    def bucket_bytes(self) -> int:
        """Target bucket size in bytes."""
        return max(1, int(self.bucket_mb * 2 ** 20))

    @property
    def itemsize(self) -> int:
        """Bytes per stored parameter or gradient element (2 for fp16 and bf16, 4 for fp32)."""
        return 4 if self.dtype == "fp32" else 2

    def to_dict(self) -> dict:
        return asdict(self)


def _known_fields_only(init):
    """ZeroConfig's __init__, which first names a keyword that is no field (Python's own TypeError does not
    say which fields there are); the signature stays the dataclass's."""
    @functools.wraps(init)
    def checked(self, *args, **kwargs):
        known = [f.name for f in fields(ZeroConfig)]
        unknown = [k for k in kwargs if k not in known]
        if unknown:
            close = difflib.get_close_matches(unknown[0], known, n=1)
            raise UnknownFieldError(f"ZeroConfig has no field {unknown[0]!r}" + (
                f" (did you mean {close[0]!r}?)" if close else "") + f"; the fields are {', '.join(known)}")
        init(self, *args, **kwargs)
    return checked


ZeroConfig.__init__ = _known_fields_only(ZeroConfig.__init__)
