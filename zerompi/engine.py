"""ZeroEngine: sharded parameters, gradients and AdamW state for stages 0-3.

The model drives it layer by layer::

    engine.begin_forward()                       # optional hint: the visit order that follows
    for layer in range(L):                       # forward
        with engine.unsharded(layer) as p: ...   # stage 3 gathers here (and prefetches the next buckets)
    engine.begin_backward()
    for layer in reversed(range(L)):             # backward
        with engine.unsharded(layer) as p: ...
        engine.grads_ready(layer, grads)         # starts the bucket's reduce-scatter
    result = engine.step()                       # stages 1/2: starts the parameter all-gathers

Communication runs behind compute: collectives are non-blocking, tested (moved on) at every
unshard, reshard and grads_ready, and waited for only when their data is read
(docs/overlap.md). ``engine.timers`` says where the time went. Parameter gathering
(unshard, reshard, params, prefetch) lives in zerompi/unshard.py, the gradient path
(grads_ready, staging, reduce-scatters) in zerompi/gradients.py, the bucket buffer pool in
zerompi/buffers.py.

Gradients handed back are those of this rank's micro-batch loss, times ``loss_scale``;
the engine averages them over ranks and micro-batches.
"""
import math
import weakref
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
from mpi4py import MPI

from . import optim
from .comm import Communicator, Handle
from .config import ZeroConfig
from .consistency import check_consistent
from .errors import ConfigError, UsageError
from .faults import GradientGuard, fault_from_env
from .layout import FlatLayout
from .loss_scale import DynamicLossScaler
from .memory import MemoryLedger, theory_bytes, theory_comm_bytes
from .schedule import Phase
from .timers import StepTimers
from .buffers import BucketPool, buffer_classes, buffer_counts   # the last two: also zerompi.engine.*
from .gradients import MAX_PENDING_REDUCES, GradientMixin   # the constant: also zerompi.engine.*
from .unshard import BucketState, UnshardMixin   # BucketState: also zerompi.engine.BucketState
from .watchdog import Watchdog, watched

F32 = np.float32
LayersArg = Union[Mapping[str, Mapping[str, np.ndarray]], Sequence[Tuple[str, Mapping[str, np.ndarray]]]]


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did."""
    step: int            # optimizer steps applied so far (skipped steps do not count)
    skipped: bool        # True when a non-finite gradient made every rank skip the update
    grad_norm: float     # global L2 norm of the true (unscaled, unclipped) gradient; inf/nan if skipped
    clip_coef: float     # factor applied to the gradient by clipping (1.0 = not clipped)
    loss_scale: float    # the loss scale used for this step's gradients


class ZeroEngine(GradientMixin, UnshardMixin):
    """ZeRO data parallelism over ``comm`` for a model given as named layers of named arrays.

    ``layers``: an ordered mapping (or list of pairs) layer name -> {param name -> array};
    every rank must pass the same initial values. ``config``: a ZeroConfig.
    ``comm``: an mpi4py communicator (default COMM_WORLD) or a zerompi Communicator.
    """

    def __init__(self, layers: LayersArg, config: Optional[ZeroConfig] = None, comm=None, xp=np):
        self.config = config or ZeroConfig()
        # A Communicator, or one with its interface (staging.StagedCommunicator); else an mpi4py communicator.
        self.comm = comm if hasattr(comm, "ireduce_scatter") else Communicator(comm)
        self.xp = xp
        self.rank, self.world_size = self.comm.rank, self.comm.size
        self.optimizer_impl = optim.use_impl(self.config.optimizer_impl, xp, verbose=self.rank == 0)  # "fused"/"numpy"
        self.dtype = np.float16 if self.config.dtype == "fp16" else np.float32
        pairs = list(layers.items()) if isinstance(layers, Mapping) else list(layers)
        spec = [(lname, [(pname, np.shape(a)) for pname, a in params.items()]) for lname, params in pairs]
        self.layout = FlatLayout(spec, self.world_size, max(1, self.config.bucket_bytes // np.dtype(self.dtype).itemsize),
                                 self.config.align)
        self._start_guards()
        self.ledger = MemoryLedger(xp)
        self.scaler = DynamicLossScaler(self.config.init_loss_scale, self.config.loss_scale_window,
                                        self.config.min_loss_scale, enabled=self.config.dtype == "fp16")
        self.step_count = 0             # optimizer updates applied
        self.steps_taken = 0            # step() calls, skipped ones included
        self.closed = False
        self.timers = StepTimers()                      # phase and communication seconds (timers.py)
        self._phase = Phase.IDLE                        # where the step is: drives prefetch and timers
        self._last_layer: Optional[int] = None          # layer of the latest unshard (direction inference)
        self._in_flight: Dict[Handle, None] = {}        # started collectives not yet seen complete
        self._progress_thread = None
        if self.config.progress == "thread":
            from .progress import ProgressThread
            with watched(self.comm, "progress thread: duplicating the communicator"):   # a collective
                self._progress_thread = ProgressThread(self.comm.mpi)
        self._allocate()
        self._load_initial(pairs)
        self._init_unshard()                            # bucket states, gathered buckets, holds (unshard.py)
        self._staging: Dict[int, np.ndarray] = {}      # stage 2/3: bucket -> local gradient bucket
        self._pool = BucketPool(self.ledger, self.dtype, self._plan_buffer_classes())   # transient bucket buffers
        self._reduce_handles: Dict[int, Handle] = {}   # bucket -> in-flight reduce-scatter
        self._ready = [False] * self.layout.num_layers # layers whose grads arrived this micro-batch
        self._bucket_pending = [len(b.layers) for b in self.layout.buckets]
        self._micro = 0                                 # micro-batches completed since the last step

    # ---- set-up ------------------------------------------------------------
    def _allocate(self) -> None:
        lay, st, dt, L = self.layout, self.config.stage, self.dtype, self.ledger
        full, shard = lay.numel, lay.shard_numel
        self.params_flat = L.alloc("params", full if st < 3 else shard, dt)
        self.grads_flat = L.alloc("grads", full if st < 2 else shard, dt)
        opt = full if st == 0 else shard
        self.master = L.alloc("optimizer", opt, F32)
        self.exp_avg = L.alloc("optimizer", opt, F32)
        self.exp_avg_sq = L.alloc("optimizer", opt, F32)
        # Stages 0/1 with several micro-batches: the local gradient buffer is rewritten by
        # every backward, so the reduced sum over micro-batches needs a home of its own.
        self.grad_accum = None
        if st < 2 and self.config.micro_batches > 1:
            self.grad_accum = L.alloc("buffers", shard, dt)

    def _plan_buffer_classes(self) -> Dict[int, int]:
        """The pool's classes for this layout, sized for the most buffers the schedule holds at once."""
        c, lay = self.config, self.layout
        lengths: Dict[int, int] = {}
        for bucket in lay.buckets:
            lengths[bucket.numel] = lengths.get(bucket.numel, 0) + 1
        staged, gathered = buffer_counts(c.stage, len(lay.buckets), MAX_PENDING_REDUCES if c.overlap else 0,
                                         c.prefetch if c.overlap else 0)
        return buffer_classes(lengths, staged, gathered)

    def _load_initial(self, pairs) -> None:
        """Fill the fp32 master (and the stored parameters) from the caller's arrays."""
        lay = self.layout
        full = np.zeros(lay.numel, F32) if self.config.stage == 0 else None
        for lname, params in pairs:
            for pname, arr in params.items():
                pr = lay.params[pname]
                values = np.asarray(arr, dtype=F32).reshape(-1)
                if full is not None:
                    full[pr.start:pr.stop] = values
                    continue
                for b in [lay.buckets[pr.bucket]]:
                    lo, hi = b.slice_bounds(self.rank)
                    a, z = max(lo, pr.bucket_offset), min(hi, pr.bucket_offset + pr.numel)
                    if a < z:
                        dst = b.shard_start + (a - lo)
                        self.master[dst:dst + (z - a)] = self.xp.asarray(values[a - pr.bucket_offset:z - pr.bucket_offset])
        if full is not None:
            self.master[...] = self.xp.asarray(full)
        self._publish_params(all_gather=True)

    # ---- where things are --------------------------------------------------
    def _grad_slice(self, b) -> np.ndarray:
        """This rank's reduced-gradient slice of bucket b (where the reduce-scatter lands)."""
        bucket = self.layout.buckets[b]
        if self.config.stage < 2:
            return self.grads_flat[bucket.world_slice(self.rank)]
        return self.grads_flat[bucket.shard_slice]

    def _param_slice(self, b) -> np.ndarray:
        bucket = self.layout.buckets[b]
        if self.config.stage < 3:
            return self.params_flat[bucket.world_slice(self.rank)]
        return self.params_flat[bucket.shard_slice]

    # ---- the step's phase: what the timers charge, the direction prefetch follows ----
    def _enter(self, phase: Phase) -> None:
        self._phase = phase
        self.timers.enter(phase)

    # ---- collectives in flight -----------------------------------------------------
    def _launch(self, start) -> Handle:
        """Start a collective (``start()`` returns its Handle), counted as in flight until seen complete."""
        self.timers.comm_started()
        with self.timers.exposed():
            handle = start()
        self._in_flight[handle] = None
        if self._progress_thread is not None:
            self._progress_thread.busy(True)
        return handle

    def _seen_complete(self, handle: Handle) -> None:
        del self._in_flight[handle]
        self.timers.comm_completed()
        if self._progress_thread is not None and not self._in_flight:
            self._progress_thread.busy(False)

    def _await(self, handle: Handle) -> None:
        """Block until the handle's data has arrived (exposed time), then run its local part."""
        if handle in self._in_flight:
            with self.timers.exposed(), self.comm.waiting(handle.op, handle.tag):   # the watchdog times this
                while not handle.test():     # test, not wait: the local sum below is compute, not waiting
                    pass
            self._seen_complete(handle)
        handle.wait()

    def _progress(self) -> None:
        """Test every in-flight collective once -- this is what moves them on between layers --
        and retire those that have arrived (a reduction's staging bucket is freed at once)."""
        if not self._in_flight:
            return
        with self.timers.exposed():
            arrived = [h for h in self._in_flight if h.test()]
        for h in arrived:
            self._seen_complete(h)
        for b, h in list(self._reduce_handles.items()):
            if h not in self._in_flight:
                self._finish_reduce(b)
        for b, h in list(self._gather_handles.items()):
            if h not in self._in_flight:
                self._finish_gather(b)

    def synchronize(self) -> None:
        """Complete every in-flight collective (gradient reductions, parameter all-gathers).

        Call it before touching the engine's buffers other than through unshard, params and
        step: full_parameters, close and checkpoints do. Every rank must call it.
        """
        for b in list(self._reduce_handles):
            self._finish_reduce(b)
        for b in list(self._gather_handles):
            self._finish_gather(b)

    def _take_buffer(self, numel: int) -> np.ndarray:
        """A transient bucket buffer of ``numel`` elements (stage-3 gather, gradient staging): buffers.BucketPool."""
        return self._pool.take(numel)

    def _release_buffer(self, buf: np.ndarray) -> None:
        """Give a bucket buffer back to the pool (kept for reuse until close)."""
        self._pool.give(buf)

    # ---- the optimizer step -------------------------------------------------
    def step(self, lr: Optional[float] = None) -> StepResult:
        """Finish the reductions, check for overflow, clip, update the shard, publish parameters.

        Every rank must call it after the configured number of micro-batches.
        ``lr`` overrides config.lr for this step (a schedule); it must be the same on every rank.
        """
        self._check_open()
        if lr is not None and not lr > 0:
            raise ConfigError(f"lr={lr!r} must be > 0")
        if any(self._ready) or self._micro != self.config.micro_batches:
            done = sum(self._ready)
            raise UsageError(f"step() after {self._micro} of {self.config.micro_batches} micro-batches "
                             f"({done} of {self.layout.num_layers} layers handed back in the current one); "
                             "hand back every layer's gradients for every micro-batch first")
        self._enter(Phase.OPTIMIZER)
        self.synchronize()
        if self.config.stage == 3:
            self._free_gathered()
        lay = self.layout
        if self.grad_accum is not None:
            for bucket in lay.buckets:
                self._grad_slice(bucket.index)[...] = self.grad_accum[bucket.shard_slice]
        sumsq, nonfinite = 0.0, False
        for bucket in lay.buckets:
            s, bad = optim.grad_stats(self._grad_slice(bucket.index))
            sumsq += s
            nonfinite |= bad
        with self.timers.blocking():
            total = self.comm.sum_scalars([sumsq, float(nonfinite)])
        scale = self.scaler.scale
        overflow = bool(total[1] > 0) or not math.isfinite(total[0])
        self.steps_taken += 1
        self._micro = 0
        if overflow:   # fp32, or too many fp16 skips in a row: NonFiniteError on every rank, nothing updated
            self._guard.on_skip(self.steps_taken, self.comm, [self._grad_slice(b.index) for b in lay.buckets], scale)
            self.scaler.update(True)
            self._end_step()
            return StepResult(self.step_count, True, float("nan"), 1.0, scale)
        norm = math.sqrt(total[0]) / scale
        clip = self.config.clip
        coef = clip / (norm + 1e-6) if clip > 0 and norm > clip else 1.0
        self.step_count += 1
        if self.config.stage == 0:
            with self.timers.blocking():
                self._all_gather_grads()
        c = self.config
        s = optim.adamw_scalars(c.lr if lr is None else lr, c.beta1, c.beta2, c.eps, c.weight_decay, self.step_count, coef / scale)
        if self.config.stage == 0:
            optim.adamw_update(self.master, self.exp_avg, self.exp_avg_sq, self.grads_flat, self.params_flat, s)
        else:
            for bucket in lay.buckets:
                sl, b = bucket.shard_slice, bucket.index
                optim.adamw_update(self.master[sl], self.exp_avg[sl], self.exp_avg_sq[sl],
                                   self._grad_slice(b), self._param_slice(b), s)   # also writes the stored copy
                if self.config.stage in (1, 2):
                    self._start_gather(b)     # publish: runs behind the next buckets' update and the next forward
                self._progress()
        self.scaler.update(False)
        self._end_step()
        return StepResult(self.step_count, False, norm, coef, scale)

    def _end_step(self) -> None:
        """Stage 3 starts gathering the next forward's first buckets; the step's timer closes."""
        if self.config.stage == 3 and self.config.overlap:
            self._prefetch_forward()
        self._last_layer = None
        self._enter(Phase.IDLE)

    def _all_gather_grads(self) -> None:
        """Stage 0: complete the all-reduce, so every rank holds the whole reduced gradient."""
        for bucket in self.layout.buckets:
            self.comm.all_gather(self.grads_flat[bucket.start:bucket.stop], (bucket.index, self.steps_taken))

    def _publish_params(self, all_gather: bool) -> None:
        """Write the stored-dtype parameters from the master; stages 1/2 then all-gather them."""
        st = self.config.stage
        if st == 0:
            self.params_flat[...] = self.master
            return
        for bucket in self.layout.buckets:
            self._param_slice(bucket.index)[...] = self.master[bucket.shard_slice]
        if all_gather and st in (1, 2):
            for bucket in self.layout.buckets:
                self.comm.all_gather(self.params_flat[bucket.start:bucket.stop])

    # ---- checkpoints (zerompi/checkpoint.py, docs/checkpoint.md) ---------------
    def save(self, path: str, extra_state: Optional[dict] = None) -> str:
        """Write a sharded checkpoint under directory ``path`` (a collective, between steps).

        Every rank writes its fp32 master, exp_avg and exp_avg_sq slices; rank 0 the manifest.
        Returns the new checkpoint directory; ``path``/latest names it once it is complete.
        """
        self._check_between_steps("save")
        from . import checkpoint
        return checkpoint.save(self, path, extra_state)

    def load(self, path: str):
        """Restore from a checkpoint saved at any world size, stage or bucket size (a collective).

        ``path``: a checkpoint directory or a save directory (its ``latest``). Returns a
        checkpoint.LoadInfo; raises checkpoint.CheckpointError on every rank on bad input.
        """
        self._check_between_steps("load")
        from . import checkpoint
        return checkpoint.load(self, path)

    def _check_between_steps(self, what: str) -> None:
        self._check_open()
        if self._micro or any(self._ready) or any(self._holds):
            raise UsageError(f"{what}() in the middle of a step (micro-batches handed back or layers "
                             "unsharded); call it after step()")
        self.synchronize()
        if self.config.stage == 3:      # a gathered bucket would go stale when the master changes
            self._free_gathered()

    # ---- results and reports ---------------------------------------------------
    @property
    def loss_scale(self) -> float:
        """Multiply the loss (or its gradient) by this before the backward (1.0 in fp32 mode)."""
        return self.scaler.scale

    def full_parameters(self) -> Dict[str, np.ndarray]:
        """Consolidated fp32 master parameters by name, as NumPy arrays (a collective: all ranks call)."""
        self._check_open()
        flat = self.gather_master()
        return {name: flat[pr.start:pr.stop].reshape(pr.shape).copy() for name, pr in self.layout.params.items()}

    def gather_master(self) -> np.ndarray:
        """The whole padded fp32 master in world layout on every rank (a collective)."""
        self.synchronize()
        lay = self.layout
        if self.config.stage == 0:
            return _to_numpy(self.master).copy()
        out = np.zeros(lay.numel, F32)
        host = _to_numpy(self.master)
        for bucket in lay.buckets:
            out[bucket.world_slice(self.rank)] = host[bucket.shard_slice]
            with self.comm.waiting("gather_master (fp32 all-gather)", (bucket.index, self.steps_taken)):
                self.comm.mpi.Allgather(MPI.IN_PLACE, out[bucket.start:bucket.stop])   # timed by the watchdog
        return out

    def unpadded_master(self) -> np.ndarray:
        """fp32 master parameters in layout order without padding (a collective)."""
        flat = self.gather_master()
        return np.concatenate([flat[pr.start:pr.stop] for pr in self.layout.params.values()])

    def memory_report(self) -> Dict[str, Dict[str, int]]:
        """Bytes per rank: ``measured`` (allocated by this engine now), ``theory`` (DESIGN.md formula
        on Psi, unpadded), ``theory_padded`` (the same formula on the padded layout),
        ``peak_buffers`` (largest transient bytes held at once, communication scratch included)."""
        lay, c = self.layout, self.config
        isz = np.dtype(self.dtype).itemsize
        measured = self.ledger.model_states()
        return {
            "measured": measured,
            "theory": theory_bytes(c.stage, lay.params_numel, self.world_size, isz),
            "theory_padded": theory_bytes(c.stage, lay.numel, self.world_size, isz, lay.shard_numel),
            "peak_buffers": {"bytes": self.ledger.peak["buffers"] + self.comm.peak_scratch_bytes},
        }

    def comm_theory_bytes(self) -> int:
        """Bytes per step one rank should send for the gradient and parameter collectives (padded layout)."""
        isz = np.dtype(self.dtype).itemsize
        return theory_comm_bytes(self.config.stage, self.layout.numel, self.world_size, isz, self.config.micro_batches)

    def close(self) -> None:
        """Free every buffer. The engine cannot be used afterwards (a collective: every rank calls it)."""
        self.synchronize()
        self._gathered.clear()
        self._pool.clear()
        if self._progress_thread is not None:
            self._progress_thread.close()
            self._progress_thread = None
        self.comm.free_scratch()
        self.params_flat = self.grads_flat = self.master = self.exp_avg = self.exp_avg_sq = None
        self._watchdog.close()
        self.closed = True

    # ---- failures (docs/failures.md) --------------------------------------------
    def _start_guards(self) -> None:
        """Before the first collective that depends on the config: start the collective
        watchdog, then check that every rank has the same ZeroConfig and layout."""
        self._guard = GradientGuard(self.rank, self.dtype, self.config.max_skipped_steps, fault_from_env())
        me = weakref.ref(self)      # the thread must not keep a forgotten engine alive
        self._watchdog = Watchdog(self.comm.waiting, self.config.timeout_s, self.rank, self.comm.mpi,
                                  step=lambda: me().steps_taken + 1)
        weakref.finalize(self, self._watchdog.close)
        try:
            check_consistent(self.comm, "engine", {"zero": self.config.to_dict(), "layout": self.layout.describe()})
        except BaseException:
            self._watchdog.close()
            raise

    # ---- checks -----------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise UsageError("this engine was closed; create a new one")

    def _check_layer(self, layer: int) -> None:
        if not (isinstance(layer, (int, np.integer)) and 0 <= layer < self.layout.num_layers):
            raise UsageError(f"layer={layer!r} is not a layer index; use 0..{self.layout.num_layers - 1}")


def _to_numpy(arr) -> np.ndarray:
    return arr.get() if hasattr(arr, "get") else np.asarray(arr)
