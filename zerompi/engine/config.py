"""ZeroConfig: every knob of the engine, validated once, frozen."""
import difflib
import functools
import math
import os
import warnings
from dataclasses import asdict, dataclass, field, fields
from typing import Callable, Optional, Tuple

import numpy as np

from ..comm.meshconfig import FIELDS as MESH_FIELDS, MeshConfig
from ..comm.quantized import DEFAULT_BLOCK, check_quantization
from ..errors import ConfigError, check
from ..flags import flag
from ..optim.impl import OPTIMIZER_IMPLS
from .optimizers import OPTIMIZERS
from ..strict import strict_fields

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


def check_optimizer(c) -> None:
    """The optimizer's fields, and what Muon cannot be combined with yet (one line each)."""
    check(c.optimizer in OPTIMIZERS, f"optimizer={c.optimizer!r} is not allowed; use one of {', '.join(OPTIMIZERS)}")
    if isinstance(c.muon_params, list):
        object.__setattr__(c, "muon_params", tuple(c.muon_params))
    check(isinstance(c.muon_params, tuple) and all(isinstance(p, str) and p for p in c.muon_params),
          f"muon_params={c.muon_params!r} must be a tuple of parameter-name patterns (non-empty strings)")
    if isinstance(c.muon_stacked, list):
        object.__setattr__(c, "muon_stacked", tuple(c.muon_stacked))
    check(isinstance(c.muon_stacked, tuple) and all(isinstance(p, str) and p for p in c.muon_stacked),
          f"muon_stacked={c.muon_stacked!r} must be a tuple of parameter-name patterns (non-empty strings)")
    check_float("muon_momentum", c.muon_momentum, "in [0, 1)", lambda v: 0 <= v < 1, True)
    check(isinstance(c.fresh_optimizer_state, bool), f"fresh_optimizer_state={c.fresh_optimizer_state!r} must "
                                                      "be True or False")
    if c.optimizer == "muon":
        for name, value, none in (("offload_optimizer", c.offload_optimizer, "none"),
                                  ("offload_params", c.offload_params, "none")):
            check(value == none, f"{name}={value!r} is not available with optimizer='muon' yet (Newton-Schulz "
                                 f"needs every bucket's matrices before any is updated); use {none}")


class UnknownFieldError(ConfigError, TypeError):
    """A ZeroConfig field that does not exist (a TypeError, as Python's own, and one ConfigError line)."""


@dataclass(frozen=True)
class ZeroConfig:
    """Engine configuration. Units are in each field's docstring; invalid values raise ConfigError.

    Types, one rule for every field (checked before the values): an int field (``stage``,
    ``micro_batches``, ``prefetch``, ...) takes an int or a NumPy integer, never a bool or a float
    (``stage=3.0`` and ``stage=True`` are refused); a float field (``lr``, ``bucket_mb``, ...) takes
    an int, a float or a NumPy integer or float (``lr=np.float32(1e-3)`` is kept as the Python float
    it equals), never a bool; a bool field takes a bool or a NumPy bool, never 0 or 1. NumPy scalars
    are stored as Python's, so the config, its JSON and its digest are the same whichever was given.
    A field that does not exist is an UnknownFieldError (a ConfigError and a TypeError) naming it.
    """

    stage: int = field(default=2, metadata=flag("ZeRO stage 0, 1, 2 or 3"))
    """ZeRO stage: 0 (plain data parallel), 1 (shard optimizer state), 2 (+ gradients), 3 (+ parameters)."""
    dtype: str = field(default="fp16", metadata=flag("fp16 (with loss scaling), bf16 or fp32 storage"))
    """Storage dtype of parameters and gradients: "fp16" (with dynamic loss scaling), "bf16" (bfloat16:
    float32's range, no loss scaling; NumPy's bfloat16 comes from the ml_dtypes package) or "fp32"."""
    bucket_mb: float = field(default=25.0, metadata=flag("bucket size in MiB"))
    """Target bucket size in MiB of the storage dtype; buckets are cut at layer boundaries."""
    lr: float = field(default=1e-3, metadata=flag())
    """AdamW learning rate (> 0)."""
    beta1: float = 0.9
    """AdamW first-moment decay, in [0, 1)."""
    beta2: float = 0.999
    """AdamW second-moment decay, in [0, 1)."""
    eps: float = 1e-8
    """AdamW denominator epsilon (> 0)."""
    weight_decay: float = field(default=0.0, metadata=flag())
    """Decoupled (AdamW) weight decay, >= 0; applied to every parameter but those ``no_decay`` names."""
    no_decay: Tuple[str, ...] = field(default=(), metadata=flag(
        "parameters exempt from weight decay, by name pattern (repeat for more; default: gpt: wte, wpe, *.b, "
        "*.g (biases, LayerNorm gains, embeddings); mlp: none)", metavar="PATTERN", append=True))
    """Parameters exempt from weight decay, by shell-style patterns on their names (``"*.bias"``,
    ``"ln_f.*"``, ``"wte"``: fnmatch, case-sensitive); a pattern matching no parameter is an error
    when the engine starts. Groups follow names, so they survive resharding (engine/decay.py)."""
    clip: float = field(default=0.0, metadata=flag("global-norm clip, 0 = off"))
    """Clip gradients to this global L2 norm; 0 turns clipping off."""
    micro_batches: int = field(default=1, metadata=flag())
    """Micro-batches accumulated per optimizer step (>= 1); gradients are reduced per micro-batch."""
    init_loss_scale: float = field(default=2.0 ** 16, metadata=flag(
        "fp16 initial loss scale (default {default:g})", name="--loss-scale"))
    """fp16: starting loss scale (a power of two is exact)."""
    loss_scale_window: int = field(default=1000, metadata=flag(
        "fp16: good steps before the scale doubles (default {default})"))
    """fp16: double the loss scale after this many consecutive steps without overflow."""
    min_loss_scale: float = 1.0
    """fp16: the loss scale never drops below this."""
    optimizer_impl: str = field(default="auto", metadata=flag(
        "AdamW step: fused (one-pass kernels), numpy (reference) or auto"))
    """AdamW step and gradient pre-pass: "fused" (one-pass kernels: C on the CPU, CUDA on CuPy),
    "numpy" (the reference), or "auto" (fused when its kernels build or load, else numpy)."""
    align: int = 16
    """Each bucket slice is a multiple of this many elements (16 -> 32-byte fp16 slices)."""
    overlap: bool = field(default=True, metadata=flag(
        "wait for every collective as soon as it starts (the serial baseline)", name="--no-overlap", const=False))
    """Run collectives behind compute (non-blocking, waited for only when their data is read).
    False waits for every collective as soon as it starts: the serial baseline; prefetch is then unused."""
    prefetch: int = field(default=1, metadata=flag("stage 3: buckets gathered ahead of the computing layer (0 = off)"))
    """Stage 3: buckets gathered ahead of the layer computing now, in visit order (0 = gather on demand).
    At most 1 + prefetch gathered buckets are alive at once (plus those of layers the caller still holds)."""
    progress: str = field(default="test", metadata=flag(
        "how collectives advance: test or thread", name="--comm-progress"))
    """How in-flight collectives advance during compute: "test" (the engine tests them at every
    unshard, reshard and grads_ready) or "thread" (also a polling thread; needs MPI_THREAD_MULTIPLE)."""
    timeout_s: Optional[float] = field(default=None, metadata=flag(
        "abort the job when one collective waits longer (default: $ZEROMPI_TIMEOUT_S or 300)", metavar="S"))
    """Seconds one collective may wait before the watchdog aborts the job (> 0); only waiting counts,
    not compute. None = the environment variable ZEROMPI_TIMEOUT_S, else 300, read when the engine's
    watchdog starts (docs/failures.md); the train CLI reads it when the job starts."""
    max_skipped_steps: int = field(default=50, metadata=flag(
        "fp16: K consecutive steps skipped for non-finite gradients is an error (default {default})",
        metavar="K"))
    """fp16: this many consecutive steps skipped for non-finite gradients is an error (>= 1)."""
    lazy_publish: bool = False
    """Stages 1/2: return from step() while the new parameters' all-gathers are still in flight, each
    completed when its bucket is first read through params() or unshard() (they then run behind the
    next forward). A parameter view taken before step() holds old values until it is taken again, so
    only for code that reads parameters through params()/unshard() after every step, as the built-in
    models do. False (the default): step() returns with every parameter in place."""
    hpz: bool = field(default=False, metadata=flag(
        "stage 3: keep a node-local copy of the parameters after each gather across nodes (ZeRO++ hpZ)",
        const=True))
    """Stage 3, ZeRO++'s hpZ: keep a node-local secondary copy (1/node_size of the parameters per rank)
    after each gather across nodes, and gather from it inside the node until the next step."""
    quantize_weights: Optional[str] = field(default=None, metadata=flag(
        "stages 1-3: all-gather the parameters as int8 blocks with a scale each (ZeRO++ qwZ)",
        metavar="int8"))
    """ZeRO++ qwZ: None, or "int8": the parameter all-gathers (stage 3's, and stages 1/2's publish)
    send int8 blocks with a float32 scale each; the master stays exact (comm/quantized.py)."""
    quantize_grads: Optional[str] = field(default=None, metadata=flag(
        "reduce-scatter the gradients as int8 or int4 blocks (ZeRO++ qgZ)", metavar="int8|int4"))
    """ZeRO++ qgZ: None, "int8" or "int4": the gradient reduce-scatters send quantized blocks, summed
    in fp32 after dequantization (across nodes: each level re-quantizes its partial sum)."""
    quant_block: int = field(default=DEFAULT_BLOCK, metadata=flag(
        "elements per quantization block (a power of two >= 8; default {default})", metavar="B"))
    """Elements per quantization block (one float32 scale each): a power of two >= 8."""
    offload_optimizer: str = field(default="none", metadata=flag(
        "stages 1-3: keep the fp32 master and Adam moments in host memory (cpu) or in files under "
        "--offload-dir (nvme), updated there bucket by bucket", metavar="none|cpu|nvme"))
    """Where the fp32 master and Adam moments live (stages 1-3; engine/offload/): "none" (with the
    parameters), "cpu" (host memory; the update runs there; on the CPU device the normal path) or
    "nvme" (files under offload_dir, streamed bucket by bucket through a few host buffers)."""
    offload_params: str = field(default="none", metadata=flag(
        "stage 3: keep the stored parameter shard in a file under --offload-dir", metavar="none|nvme"))
    """Stage 3: "nvme" keeps the stored parameter shard in a file under offload_dir."""
    offload_delayed_update: bool = field(default=False, metadata=flag(
        "with --offload-optimizer cpu: run step k's update behind step k+1 (one step stale)", const=True))
    """ZeRO-Offload's one-step delayed parameter update (offload_optimizer="cpu"): step k's update runs
    on the host in the background while step k + 1's forward and backward run, so the gradients of
    step k + 1 are taken at the parameters before update k (staleness one step; docs/offload.md)."""
    offload_delayed_warmup: int = field(default=0, metadata=flag(
        "with --offload-delayed-update: the first K updates are not delayed (warm-up)", metavar="K"))
    """With offload_delayed_update: the first this many updates run in step() as without it (not
    stale); the delayed update starts after them (DeepSpeed's warm-up steps; docs/offload.md)."""
    offload_dir: Optional[str] = field(default=None, metadata=flag(
        "the folder of the offload files (nvme)", metavar="DIR"))
    """The folder of the offload files (needed by "nvme"; checked at start for room)."""
    offload_io: str = field(default="direct", metadata=flag(
        "nvme: read and write the optimizer's file with O_DIRECT (direct, the default) or through the "
        "page cache (buffered)", metavar="direct|buffered"))
    """How the optimizer's file is read and written: "direct" (O_DIRECT: the device moves the rows, no
    copy through the page cache; buffered where the filesystem refuses it, as tmpfs does) or "buffered"."""
    init_values: str = "check"
    """The initial parameter values: "check" (every rank must pass the same; a difference stops every
    rank, naming the parameter and the ranks) or "broadcast" (rank 0's values are used on every rank)."""
    abort_on_exception: bool = True
    """An uncaught exception on any rank ends every rank of the job (MPI Abort) instead of leaving the
    others waiting in a collective until timeout_s; False leaves sys.excepthook alone."""
    trace: Optional[str] = field(default=None, metadata=flag(
        "write a timeline of every rank's compute and collectives to FILE (Chrome trace-event JSON: open it in "
        "ui.perfetto.dev or chrome://tracing)", metavar="FILE"))
    """Record a timeline of every rank's compute and collectives and write it to this file at close(), as
    Chrome trace-event JSON (Perfetto, chrome://tracing; engine/trace.py). None (the default): off."""
    trace_steps: int = field(default=20, metadata=flag(
        "with --trace: keep the last K steps (default {default})", metavar="K"))
    """With trace: the timeline keeps the last this many steps (>= 1) and the step in progress."""

    optimizer: str = field(default="adamw", metadata=flag(
        "the optimizer: adamw, or muon (Muon on the 2-D matrices --muon-params names, AdamW on the rest)",
        metavar="adamw|muon"))
    """The optimizer on the shard (engine/optimizers.py): "adamw", or "muon" (Nesterov momentum and
    Newton-Schulz on the 2-D parameters ``muon_params`` names, each matrix on one owner rank; AdamW with
    the same lr and decay on every other parameter; docs/optimizers.md)."""
    muon_params: Tuple[str, ...] = field(default=("*",), metadata=flag(
        "with --optimizer muon: the parameters Muon updates, by name pattern, of which the 2-D ones (repeat "
        "for more; default: gpt: *.w (attention and MLP weights); mlp: *.weight)", metavar="PATTERN",
        append=True))
    """With optimizer="muon": shell-style patterns naming the parameters Muon updates (its 2-D ones; the
    rest take AdamW). A pattern that matches no parameter, or patterns that match no 2-D one, are an error."""
    muon_stacked: Tuple[str, ...] = ()
    """With optimizer="muon": patterns naming the parameters that are stacks over their first axis (an MoE's
    experts, (E, rows, cols), set by the train job): each slice is a matrix of its own, and a stack of vectors
    (the experts' biases) is no matrix (engine/matrix_owners.py)."""
    muon_momentum: float = 0.95
    """Muon's (Nesterov) momentum, in [0, 1)."""
    fresh_optimizer_state: bool = field(default=False, metadata=flag(
        "--resume from a checkpoint of another optimizer: keep its parameters, start the optimizer state "
        "fresh (zeros)", const=True))
    """Loading a checkpoint saved by another optimizer (its name in the manifest) is an error unless this
    is True: then its master is loaded and the state rows start at zero."""

    def __post_init__(self):
        strict_fields(self)
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
        check_optimizer(self)
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

    mesh = MeshConfig()
    """Deprecated: the mesh given as ZeroConfig(tp=..., node_size=...), a MeshConfig (else the default's; not a
    field: dataclasses.replace drops it)."""


def _forward(name: str) -> property:
    return property(lambda self: getattr(self.mesh, name),
                    doc=f"Deprecated: MeshConfig.{name} (ZeroConfig(tp=...) still sets it for one release).")


for _name in MESH_FIELDS:
    setattr(ZeroConfig, _name, _forward(_name))


def _known_fields_only(init):
    """ZeroConfig's __init__, which first names a keyword that is no field (Python's own TypeError does not
    say which fields there are) and takes the mesh's fields that moved to MeshConfig (tp, sp, pp, node_size,
    shard_size) with a DeprecationWarning; the signature stays the dataclass's."""
    @functools.wraps(init)
    def checked(self, *args, **kwargs):
        known = [f.name for f in fields(ZeroConfig)]
        unknown = [k for k in kwargs if k not in known and k not in MESH_FIELDS]
        if unknown:
            close = difflib.get_close_matches(unknown[0], known, n=1)
            raise UnknownFieldError(f"ZeroConfig has no field {unknown[0]!r}" + (
                f" (did you mean {close[0]!r}?)" if close else "") + f"; the fields are {', '.join(known)}")
        moved = {k: kwargs.pop(k) for k in MESH_FIELDS if k in kwargs}
        if moved:
            warnings.warn(f"ZeroConfig({', '.join(moved)}=...) is deprecated: the mesh is MeshConfig's; pass "
                          "zerompi.Mesh(...) as the engine's comm, or mesh_config=MeshConfig(...)",
                          DeprecationWarning, stacklevel=2)
        init(self, *args, **kwargs)
        if moved:
            object.__setattr__(self, "mesh", MeshConfig(**moved))
    return checked


ZeroConfig.__init__ = _known_fields_only(ZeroConfig.__init__)
