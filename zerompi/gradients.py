"""Gradients: the reduce half of ZeroEngine.

The model hands back each layer's gradients (``grads_ready``); they are written in the
storage dtype into the bucket's local gradient buffer (stages 0/1: the full local gradient;
stages 2/3: a transient staging bucket from the engine's pool), and once every layer of a
bucket has handed its gradients back, the bucket's reduce-scatter starts, non-blocking, into
this rank's gradient shard (or the micro-batch accumulator). At most MAX_PENDING_REDUCES
reductions are in flight: each pins a staging bucket and a receive buffer.
"""
from typing import Mapping

import numpy as np

from .errors import UsageError
from .schedule import Phase

MAX_PENDING_REDUCES = 2   # gradient reduce-scatters in flight at once (per rank)


class GradientMixin:
    """ZeroEngine's gradient path: grads_ready, the staging buckets and the reduce-scatters.

    Reads the engine's ``layout``, ``config``, ``comm``, ``world_size``, ``grads_flat``,
    ``grad_accum``, ``steps_taken``, ``_micro``, ``_phase``, ``_ready``, ``_bucket_pending``,
    ``_staging``, ``_reduce_handles`` and ``_guard``; uses its ``_launch``, ``_await``,
    ``_progress``, ``_take_buffer``, ``_release_buffer``, ``_grad_slice``, ``_enter``,
    ``_check_open`` and ``_check_layer``.
    """

    def grads_ready(self, layer: int, grads: Mapping[str, np.ndarray]) -> None:
        """Hand back layer's gradients for this micro-batch (every parameter, its shape).

        They are stored in the storage dtype; when every layer of a bucket has handed
        its gradients back, that bucket's reduce-scatter starts (non-blocking).
        """
        self._check_open()
        self._check_layer(layer)
        lay = self.layout
        names = lay.layer_params[layer]
        if self._ready[layer]:
            raise UsageError(f"gradients of layer {layer} ({lay.layer_names[layer]!r}) handed back twice "
                             "in one micro-batch; call step() after the last micro-batch")
        missing = [n for n in names if n not in grads]
        extra = [n for n in grads if n not in names]
        if missing or extra:
            raise UsageError(f"layer {layer} ({lay.layer_names[layer]!r}): gradients missing for {missing}, "
                             f"unknown names {extra}; expected exactly {names}")
        for n in names:
            g = grads[n]
            if tuple(g.shape) != lay.params[n].shape:
                raise UsageError(f"gradient {n!r} has shape {tuple(g.shape)}; the parameter's shape is {lay.params[n].shape}")
            if not np.issubdtype(np.dtype(g.dtype), np.floating):
                raise UsageError(f"gradient {n!r} has dtype {g.dtype}; a floating dtype is required")
        if self._micro == self.config.micro_batches:
            raise UsageError(f"all {self.config.micro_batches} micro-batches already handed back; call step() first")
        if self._phase is not Phase.BACKWARD:     # gradients arriving: the backward has begun
            self._enter(Phase.BACKWARD)
        b = lay.layer_bucket[layer]
        grads = self._guard.on_grads(self.steps_taken + 1, b, grads)   # notes non-finite values; ZEROMPI_FAULT
        if b in self._reduce_handles:      # the previous micro-batch still reads this bucket
            self._finish_reduce(b)
        staging = self._local_bucket(b)
        with np.errstate(over="ignore", invalid="ignore"):   # fp16 overflow is detected in step()
            for n in names:
                pr = lay.params[n]
                staging[pr.bucket_offset:pr.bucket_offset + pr.numel] = grads[n].reshape(-1)
        self._ready[layer] = True
        self._bucket_pending[b] -= 1
        if self._bucket_pending[b] == 0:
            self._start_reduce(b)
        self._progress()
        if all(self._ready):
            self._micro += 1
            self._ready = [False] * lay.num_layers
            self._bucket_pending = [len(bk.layers) for bk in lay.buckets]
            self._enter(Phase.IDLE)

    def _local_bucket(self, b: int) -> np.ndarray:
        """Where this rank's unreduced gradients of bucket b are written."""
        bucket = self.layout.buckets[b]
        if self.config.stage < 2:
            return self.grads_flat[bucket.start:bucket.stop]
        if b not in self._staging:
            buf = self._take_buffer(bucket.numel)
            buf[bucket.used:] = 0          # padding joins the sum: it must be zero
            self._staging[b] = buf
        return self._staging[b]

    def _start_reduce(self, b: int) -> None:
        bucket = self.layout.buckets[b]
        first = self._micro == 0
        if self.grad_accum is not None:
            out = self.grad_accum[bucket.shard_slice]
        else:
            out = self._grad_slice(b)
        scale = 1.0 / (self.world_size * self.config.micro_batches)
        send = self._local_bucket(b)
        tag = (b, self.steps_taken + 1)            # what a watchdog message names
        # Bound the reductions in flight: each pins a staging bucket and a receive buffer, and
        # without a cap a slow network would let stages 2/3 hold the whole local gradient.
        while len(self._reduce_handles) >= MAX_PENDING_REDUCES:
            self._finish_reduce(next(iter(self._reduce_handles)))
        self._reduce_handles[b] = self._launch(lambda: self.comm.ireduce_scatter(send, out, scale, not first, tag))
        if not self.config.overlap:
            self._finish_reduce(b)

    def _finish_reduce(self, b: int) -> None:
        self._await(self._reduce_handles.pop(b))
        if b in self._staging:
            self._release_buffer(self._staging.pop(b))
