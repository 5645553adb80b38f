"""The gradient reducer: gradients handed back, bucketed, reduce-scattered into the shard.

The model hands back each layer's gradients (:meth:`GradientReducer.add`); they are written
in the storage dtype into the bucket's local gradient buffer (stages 0/1: the full local
gradient; stages 2/3: a transient staging bucket from the engine's pool), and once every
layer of a bucket has handed its gradients back, the bucket's reduce-scatter starts,
non-blocking, into this rank's gradient shard (or the micro-batch accumulator). At most
MAX_PENDING_REDUCES reductions are in flight: each pins a staging bucket and a receive buffer.

Reductions start in a fixed order, the last bucket first (the order a backward pass
completes them), whatever order the gradients arrive in: MPI pairs one rank's collectives
with the others' by call order, so ranks handing layers back in different orders (a layer
skipped on one rank, data-dependent control flow, another loop order) would otherwise sum
one bucket's gradients with another's. A bucket completed out of that order is held,
staged, until every bucket after it has started; ranks handing back in another order get the
same bits, with less overlap and (stages 2/3) more staging memory.
"""
from typing import Dict, List, Mapping

import numpy as np

from ..comm.quantized import quantization
from ..errors import UsageError
from ..optim import dtypes, impl

MAX_PENDING_REDUCES = 2   # gradient reduce-scatters in flight at once (per rank)


class GradientReducer:
    """Owns the gradient buffers (the local or sharded gradient, the micro-batch accumulator,
    the staging buckets) and the reductions in flight.

    Uses the engine's ``layout``, ``config``, ``comm`` (the shard group's Communicator, flat or
    two-level: comm/topology.py), ``replica`` (the Communicator across shard groups, or None),
    ``ranks`` (every rank of the job: the average's divisor), ``inflight`` (where its
    collectives are started and polled), ``pool`` (staging buckets), ``ledger`` (where its
    buffers are counted) and ``guard`` (faults.GradientGuard).
    """

    def __init__(self, layout, config, comm, replica, ranks, inflight, pool, ledger, guard, dtype, sources=1,
                 per_node=None):
        self.layout, self.config, self.comm, self.replica = layout, config, comm, replica
        # sources > 1 (expert parallelism): each gradient comes as that many partials, a source's each, reduced
        # in (rank, source) order (comm/sources_reduce.py) from buffers of their own, overlapped as the rest
        # (per_node: the world's node size in sources, where a rank's sources span whole nodes)
        self.sources, self.sourced, self.per_node = sources, {}, per_node
        self.inflight, self.pool, self.guard = inflight, pool, guard
        st = config.stage
        self.slot, self.world_size = comm.slot, ranks
        self.quant = quantization(config.quantize_grads, config.quant_block)   # qgZ, or None
        # The gradient model state: stages 0/1 the whole local gradient, stages 2/3 the shard.
        self.grads = ledger.alloc("grads", layout.numel if st < 2 else layout.shard_numel, dtype)
        # Stages 0/1 with several micro-batches: the local gradient buffer is rewritten by
        # every backward, so the reduced sum over micro-batches needs a home of its own.
        self.accum = None
        if st < 2 and config.micro_batches > 1:
            self.accum = ledger.alloc("buffers", layout.shard_numel, dtype)
        self.staging: Dict[int, np.ndarray] = {}   # stages 2/3: bucket -> local gradient bucket
        self.handles: Dict[int, object] = {}       # bucket -> in-flight reduce-scatter
        self.ready = [False] * layout.num_layers   # layers whose grads arrived this micro-batch
        self._bucket_pending = [len(b.layers) for b in layout.buckets]
        self._next = len(layout.buckets) - 1       # the bucket whose reduction starts next (the fixed order)
        self.held: List[int] = []                  # complete buckets waiting for their turn
        self.micro = 0                             # micro-batches completed since the last step
        # on_final(b): bucket b's reduced shard is final (engine/in_backward.py)
        self.on_final = None
        self._final = set()                        # buckets whose reduction in flight is their last of the step

    # ---- where the gradients are -------------------------------------------------
    def grad_slice(self, b: int) -> np.ndarray:
        """This rank's reduced-gradient slice of bucket b (where the reduce-scatter lands)."""
        bucket = self.layout.buckets[b]
        if self.config.stage < 2:
            return self.grads[bucket.world_slice(self.slot)]
        return self.grads[bucket.shard_slice]

    def final_slice(self, b: int) -> np.ndarray:
        """Where bucket b's reduced gradient shard is once its last reduction is done (stages 0/1 with
        micro-batches: the accumulator, moved into grad_slice(b) by collect())."""
        return self.accum[self.layout.buckets[b].shard_slice] if self.accum is not None else self.grad_slice(b)

    def reduced_slices(self) -> List[np.ndarray]:
        return [self.grad_slice(b.index) for b in self.layout.buckets]

    def stats(self):
        """(sum of squares, any non-finite) of this rank's reduced gradient shard (one fused pass each)."""
        sumsq, nonfinite = 0.0, False
        for g in self.reduced_slices():
            s, bad = impl.grad_stats(g)
            sumsq += s
            nonfinite |= bad
        return sumsq, nonfinite

    @property
    def mid_step(self) -> bool:
        """Gradients of this step handed back (some layers, or whole micro-batches)."""
        return self.micro > 0 or any(self.ready)

    # ---- gradients handed back ----------------------------------------------------
    def check_grads(self, layer: int, grads: Mapping[str, np.ndarray]) -> None:
        """UsageError unless ``grads`` are layer's gradients, due now: every name, its shape, floating."""
        lay = self.layout
        names = lay.layer_params[layer]
        if self.ready[layer]:
            raise UsageError(f"gradients of layer {layer} ({lay.layer_names[layer]!r}) handed back twice "
                             "in one micro-batch; call step() after the last micro-batch")
        missing = [n for n in names if n not in grads]
        extra = [n for n in grads if n not in names]
        if missing or extra:
            raise UsageError(f"layer {layer} ({lay.layer_names[layer]!r}): gradients missing for {missing}, "
                             f"unknown names {extra}; expected exactly {names}")
        for n in names:
            g = grads[n]
            if not (hasattr(g, "shape") and hasattr(g, "dtype")):
                raise UsageError(f"gradient {n!r} is a {type(g).__name__}; pass an array (NumPy, or CuPy on the "
                                 f"GPU) of shape {lay.params[n].shape}")
            want = lay.params[n].shape if self.sources == 1 else (self.sources,) + lay.params[n].shape
            if tuple(g.shape) != want:
                raise UsageError(f"gradient {n!r} has shape {tuple(g.shape)}; "
                                 f"the parameter's shape is {lay.params[n].shape}"
                                 + (f", with {self.sources} sources {want}" if self.sources > 1 else ""))
            if not dtypes.is_float(g.dtype):
                raise UsageError(f"gradient {n!r} has dtype {g.dtype}; a floating dtype is required")
        if self.micro == self.config.micro_batches:
            raise UsageError(f"all {self.config.micro_batches} micro-batches already handed back; call step() first")

    def add(self, layer: int, grads: Mapping[str, np.ndarray], step: int) -> bool:
        """Store layer's gradients (checked by :meth:`check_grads`) for step ``step`` (1-based);
        start the bucket's reduce-scatter once the bucket is complete. True when this
        completed a micro-batch."""
        lay = self.layout
        b = lay.layer_bucket[layer]
        grads = self.guard.on_grads(step, b, grads)   # notes non-finite values; ZEROMPI_FAULT
        if b in self.handles:              # the previous micro-batch still reads this bucket
            self.finish(b)
        staging = self._local_bucket(b) if self.sources == 1 else self._sourced_bucket(b)
        with np.errstate(over="ignore", invalid="ignore"):   # fp16 overflow is detected in step()
            for n in lay.layer_params[layer]:
                pr = lay.params[n]
                staging[..., pr.bucket_offset:pr.bucket_offset + pr.numel] = grads[n].reshape(self.sources, -1) \
                    if self.sources > 1 else grads[n].reshape(-1)
        self.ready[layer] = True
        self._bucket_pending[b] -= 1
        if self._bucket_pending[b] == 0:
            self.held.append(b)
            while self._next in self.held:         # start every complete bucket whose turn has come
                self.held.remove(self._next)
                self._start(self._next, step)
                self._next -= 1
        self.inflight.poll()
        if not all(self.ready):
            return False
        self.micro += 1
        self.ready = [False] * lay.num_layers
        self._bucket_pending = [len(bk.layers) for bk in lay.buckets]
        self._next = len(lay.buckets) - 1
        return True

    def _local_bucket(self, b: int) -> np.ndarray:
        """Where this rank's unreduced gradients of bucket b are written."""
        bucket = self.layout.buckets[b]
        if self.config.stage < 2:
            return self.grads[bucket.start:bucket.stop]
        if b not in self.staging:
            buf = self.pool.take(bucket.numel)
            buf[bucket.used:] = 0          # padding joins the sum: it must be zero
            self.staging[b] = buf
        return self.staging[b]

    def _sourced_bucket(self, b: int) -> np.ndarray:
        """sources > 1: the (sources, bucket) buffer of bucket b's partials, zeros where nothing is written."""
        if b not in self.sourced:
            xp = impl.array_module(self.grads)          # the engine's arrays: NumPy, or CuPy on a GPU
            self.sourced[b] = xp.zeros((self.sources, self.layout.buckets[b].numel), self.grads.dtype)
        return self.sourced[b]

    # ---- reductions ------------------------------------------------------------
    def _start(self, b: int, step: int) -> None:
        bucket = self.layout.buckets[b]
        first = self.micro == 0
        out = self.accum[bucket.shard_slice] if self.accum is not None else self.grad_slice(b)
        scale = 1.0 / (self.world_size * self.sources * self.config.micro_batches)   # every rank's every micro-batch
        tag = (b, step)            # what a watchdog message names
        if self.sources > 1:       # its own buffer of the partials, handed to the exchange; never on_final's
            from ..comm.sources_reduce import ireduce_scatter_sources
            sourced = self.sourced.pop(b)
            start = lambda: ireduce_scatter_sources(self.comm, sourced, out, scale, not first,  # noqa: E731
                                                    self.sources, tag, self.per_node)
        else:
            send = self._local_bucket(b)
            if self.config.stage < 2:      # the whole local gradient, reduced in place: the padding joins the sum
                send[bucket.used:] = 0     # and must be zero (qgZ's sum of a block with an inf wrote NaN there)
            if self.micro == self.config.micro_batches - 1:
                self._final.add(b)
            start = lambda: self.comm.ireduce_scatter(send, out, scale, not first, tag, self.quant)  # noqa: E731
        # Bound the reductions in flight: each pins a staging bucket and a receive buffer, and
        # without a cap a slow network would let stages 2/3 hold the whole local gradient.
        while len(self.handles) >= MAX_PENDING_REDUCES:
            self.finish(next(iter(self.handles)))
        self.handles[b] = self.inflight.launch(start, lambda: self.finish(b))
        if not self.config.overlap:
            self.finish(b)

    def finish(self, b: int) -> None:
        """Complete bucket b's reduce-scatter and give its staging bucket back."""
        self.inflight.finish(self.handles.pop(b))
        if b in self.staging:
            self.pool.give(self.staging.pop(b))
        if b in self._final:
            self._final.discard(b)
            if self.on_final is not None:
                self.on_final(b)

    def finish_all(self) -> None:
        for b in list(self.handles):
            self.finish(b)

    # ---- at the step ---------------------------------------------------------------
    def check_complete(self) -> None:
        """UsageError unless every micro-batch's gradients have been handed back."""
        if any(self.ready) or self.micro != self.config.micro_batches:
            raise UsageError(f"step() after {self.micro} of {self.config.micro_batches} micro-batches "
                             f"({sum(self.ready)} of {self.layout.num_layers} layers handed back in the current "
                             "one); hand back every layer's gradients for every micro-batch first")

    def collect(self) -> None:
        """Every reduction done; stages 0/1 with micro-batches move the accumulated sums into
        the gradient slices the step reads. The next step's micro-batches start from zero."""
        self.finish_all()
        if self.accum is not None:
            for bucket in self.layout.buckets:
                self.grad_slice(bucket.index)[...] = self.accum[bucket.shard_slice]
        self.micro = 0

    def reduce_replicas(self) -> None:
        """Shard groups: sum each reduced slice over the groups holding the same slice (an
        all-reduce across groups, once per step: the micro-batches were summed inside the group)."""
        if self.replica is not None:
            for g in self.reduced_slices():
                self.replica.all_reduce(g)

    def all_gather(self, step: int) -> None:
        """Stage 0: complete the all-reduce, so every rank holds the whole reduced gradient."""
        for bucket in self.layout.buckets:
            self.comm.all_gather(self.grads[bucket.start:bucket.stop], (bucket.index, step))

    def close(self) -> None:
        self.finish_all()
        self.grads = self.accum = None
