"""Parameters for compute: the unshard / reshard half of ZeroEngine.

Stage 3 keeps only this rank's slice of each bucket. ``unshard(layer)`` all-gathers the
layer's bucket into a transient buffer, and starts gathering the next buckets in visit
order (the prefetch window: at most 1 + ``config.prefetch`` buckets alive, plus those of
layers still held); ``reshard(layer)`` releases it, and the buffer returns to the engine's
pool once no held layer and no window needs it. Stages 1/2 publish their parameters with
the same gathers after the step, and ``unshard`` / ``params`` wait for a bucket only when
it is read.
Each bucket's state is a :class:`BucketState` (docs/overlap.md).
"""
from contextlib import contextmanager
from enum import Enum
from typing import Dict, List

import numpy as np

from .comm import Handle
from .errors import UsageError
from .schedule import Phase, infer_phase, prefetch_window, visits_after


class BucketState(Enum):
    """Where a bucket's whole stored parameters are on this rank."""
    SHARDED = "sharded"        # stage 3: only this rank's slice exists
    GATHERING = "gathering"    # all-gather in flight (stage 3, or the stage 1/2 publish after a step)
    UNSHARDED = "unsharded"    # whole bucket present


class UnshardMixin:
    """ZeroEngine's parameter gathering: unshard, reshard, params, the visit-order hints and
    the prefetch window. Mixed into ZeroEngine, whose ``__init__`` calls :meth:`_init_unshard`.

    Reads the engine's ``layout``, ``config``, ``rank``, ``comm``, ``params_flat``,
    ``steps_taken``, ``_micro``, ``_phase`` and ``_last_layer``; uses its ``_launch``,
    ``_await``, ``_progress``, ``_take_buffer``, ``_release_buffer``, ``_enter``,
    ``_check_open`` and ``_check_layer``.
    """

    def _init_unshard(self) -> None:
        nb = len(self.layout.buckets)
        self._state = [BucketState.UNSHARDED if self.config.stage < 3 else BucketState.SHARDED] * nb
        self._gathered: Dict[int, np.ndarray] = {}     # stage 3: bucket -> whole bucket buffer
        self._gather_handles: Dict[int, Handle] = {}   # bucket -> in-flight all-gather (stage 3, or 1/2 publish)
        self._holds = [0] * self.layout.num_layers     # unshard() calls not yet matched by reshard()
        self.peak_gathered_buckets = 0                  # stage 3: most gathered buckets alive at once

    # ---- parameters for compute -------------------------------------------
    def unshard(self, layer: int) -> Dict[str, np.ndarray]:
        """Make layer's parameters whole on this rank and return them (views, storage dtype).

        Stage 3 all-gathers the layer's bucket (every rank must call this in the same
        order); stages 0-2 already hold them. Pair each call with :meth:`reshard`.
        """
        self._check_open()
        self._check_layer(layer)
        self._enter(infer_phase(self._phase, self._last_layer, layer))
        self._last_layer = layer
        b = self.layout.layer_bucket[layer]
        if self.config.stage == 3:
            window = self._window(layer)
            self._free_gathered(keep=window)
            for w in window:                 # this layer's bucket first, then the prefetches
                if self._state[w] is BucketState.SHARDED:
                    self._start_gather(w)
        self._progress()
        if self._state[b] is BucketState.GATHERING:
            self._finish_gather(b)
        self._holds[layer] += 1
        return self._views(self._bucket_params(b), b, layer)

    def reshard(self, layer: int) -> None:
        """Release layer's parameters. Stage 3 frees the gathered bucket once no layer needs it."""
        self._check_layer(layer)
        if self._holds[layer] == 0:
            raise UsageError(f"reshard({layer}) without a matching unshard({layer})")
        self._holds[layer] -= 1
        self._progress()

    @contextmanager
    def unsharded(self, layer: int):
        """``with engine.unsharded(i) as params:`` unshard on entry, reshard on exit."""
        params = self.unshard(layer)
        try:
            yield params
        finally:
            self.reshard(layer)

    def params(self, layer: int) -> Dict[str, np.ndarray]:
        """Layer's stored parameters (views). Stage 3: only between unshard and reshard."""
        self._check_open()
        self._check_layer(layer)
        b = self.layout.layer_bucket[layer]
        if self.config.stage == 3 and (self._holds[layer] == 0 or self._state[b] is not BucketState.UNSHARDED):
            raise UsageError(f"stage 3: layer {layer} ({self.layout.layer_names[layer]!r}) is sharded; "
                             "read its parameters inside engine.unsharded(layer)")
        if self._state[b] is BucketState.GATHERING:      # stages 1/2: the step's all-gather of this bucket
            self._finish_gather(b)
        return self._views(self._bucket_params(b), b, layer)

    # ---- the visit order: hints, direction, prefetch ------------------------------
    def begin_forward(self) -> None:
        """Hint: a forward pass over layers 0, 1, ... starts now (then the backward, in reverse).

        Optional: without it the direction is inferred from the unshard order. Stage 3 starts
        gathering the first buckets here (step() already did, for the first micro-batch).
        Every rank must make the same calls.
        """
        self._check_open()
        self._enter(Phase.FORWARD)
        self._last_layer = None
        if self.config.stage == 3 and self.config.overlap:
            self._prefetch_forward()
        self._progress()

    def begin_backward(self) -> None:
        """Hint: the backward pass (layers L-1, ..., 0) starts now."""
        self._check_open()
        self._enter(Phase.BACKWARD)
        self._progress()

    def _window(self, layer: int) -> List[int]:
        """Stage 3: the buckets to hold gathered while ``layer`` computes (at most 1 + prefetch)."""
        lb = self.layout.layer_bucket
        if not self.config.overlap or self.config.prefetch == 0:
            return [lb[layer]]
        more = self._micro + 1 < self.config.micro_batches
        upcoming = visits_after(layer, self._phase, self.layout.num_layers, more)
        return prefetch_window(layer, upcoming, lb, self.config.prefetch)

    def _prefetch_forward(self) -> None:
        """Stage 3: start gathering what the next forward's first layer will hold (1 + prefetch buckets)."""
        if self.config.prefetch == 0:
            return
        first = prefetch_window(None, iter(range(self.layout.num_layers)), self.layout.layer_bucket,
                                1 + self.config.prefetch)
        self._free_gathered(keep=first)
        for b in first:
            if self._state[b] is BucketState.SHARDED:
                self._start_gather(b)

    # ---- gathers ----------------------------------------------------------------------
    def _start_gather(self, b: int) -> None:
        """All-gather bucket b in place: stage 3 into a fresh bucket buffer, stages 1/2 in params_flat."""
        bucket = self.layout.buckets[b]
        if self.config.stage == 3:
            buf = self._take_buffer(bucket.numel)
            lo, hi = bucket.slice_bounds(self.rank)
            buf[lo:hi] = self.params_flat[bucket.shard_slice]
            self._gathered[b] = buf
            self.peak_gathered_buckets = max(self.peak_gathered_buckets, len(self._gathered))
        else:
            buf = self.params_flat[bucket.start:bucket.stop]
        self._state[b] = BucketState.GATHERING
        self._gather_handles[b] = self._launch(lambda: self.comm.iall_gather(buf, (b, self.steps_taken + 1)))
        if not self.config.overlap:
            self._finish_gather(b)

    def _finish_gather(self, b: int) -> None:
        self._await(self._gather_handles.pop(b))
        self._state[b] = BucketState.UNSHARDED

    def _free_gathered(self, keep=()) -> None:
        """Stage 3: drop gathered buckets outside ``keep`` that no held layer reads.

        A gather still in flight is completed first (MPI writes its buffer until then).
        """
        for b in list(self._gathered):
            if b in keep or any(self._holds[i] for i in self.layout.buckets[b].layers):
                continue
            if self._state[b] is BucketState.GATHERING:
                self._finish_gather(b)
            self._release_buffer(self._gathered.pop(b))
            self._state[b] = BucketState.SHARDED

    # ---- where the whole bucket is ----------------------------------------------------
    def _bucket_params(self, b) -> np.ndarray:
        """The whole bucket of stored parameters (stage 3: only while gathered)."""
        bucket = self.layout.buckets[b]
        if self.config.stage < 3:
            return self.params_flat[bucket.start:bucket.stop]
        return self._gathered[b]

    def _views(self, buf, bucket_index, layer) -> Dict[str, np.ndarray]:
        out = {}
        for name in self.layout.layer_params[layer]:
            pr = self.layout.params[name]
            out[name] = buf[pr.bucket_offset:pr.bucket_offset + pr.numel].reshape(pr.shape)
        return out
