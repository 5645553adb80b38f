"""A weight two chunks share (the GPT's embedding, which its output head reuses), kept in sync.

The chunk that owns it (chunk 0: the embedding lookup) trains it: its engine holds the master, the
optimizer state and the shard, as for any parameter. The chunk that reads it (the last: the head)
keeps only a copy of its stored value. Each step:

- the owner sends the stored value (what its layer's forward reads, fp16 or fp32) to the reader at
  its first forward of the step; the reader waits for it at its first forward: the value is the
  same bits on both stages;
- for every micro-batch the reader sends its gradient contribution (float32, the head's) to the
  owner as soon as it is computed; the owner adds it to its own (the lookup's) in the backward of
  the owning layer, before handing the layer's gradients to its engine: the same sum, in the same
  order, as an unpipelined model computes, so the micro-batch's gradient is reduced as it would be.

(Megatron keeps an optimizer copy on both stages and all-reduces the accumulated gradient between
them once per step; that sums in another order than a run without pipelining, and keeps the
weight's optimizer state twice. Here it is kept once, and the bits match: docs/pipeline.md.)

Messages travel over the pipeline group (PointToPoint) under their own tags (one per micro-batch
for the gradients), counted as "tied weight" traffic. Owner and reader on one rank: nothing travels.
"""
from typing import Dict, Optional

import numpy as np

VALUE_TAG, GRAD_TAG0 = 31, 1000           # gradient of micro-batch mb: GRAD_TAG0 + mb


class TiedWeight:
    """One rank's side of a tied weight: ``owner`` and ``reader`` are pipeline ranks (stages)."""

    def __init__(self, comm, owner: int, reader: int, shape, value_dtype, grad_dtype=np.float32):
        self.comm, self.owner, self.reader = comm, owner, reader
        self.shape, self.value_dtype, self.grad_dtype = tuple(shape), np.dtype(value_dtype), np.dtype(grad_dtype)
        self.local = owner == reader
        self._value_msg = None
        self._value: Optional[np.ndarray] = None
        self._grads: Dict[int, object] = {}          # mb -> posted receive (owner) or local array

    # ---- the value: owner -> reader, once per step -----------------------------------------
    def expect_value(self) -> None:
        """Reader, at the step's start: post the receive of this step's value."""
        if not self.local:
            self._value_msg = self.comm.irecv(np.empty(self.shape, self.value_dtype), self.owner, VALUE_TAG,
                                              "tied weight")

    def send_value(self, stored) -> None:
        """Owner, at its first forward of the step: the stored value (a copy travels)."""
        if self.local:
            self._value = stored.copy()
            return
        self.comm.isend_copy(stored, self.reader, VALUE_TAG, "tied weight")

    def value(self) -> np.ndarray:
        """Reader: this step's value (waits for it once)."""
        if self._value_msg is not None:
            self._value = self.comm.wait(self._value_msg, "pipeline: the tied weight's value from stage "
                                                          f"{self.owner}")
            self._value_msg = None
        return self._value

    # ---- the gradient: reader -> owner, per micro-batch ----------------------------------------
    def expect_grad(self, mb: int) -> None:
        """Owner, at its forward of micro-batch ``mb``: post the receive of the reader's contribution."""
        if not self.local:
            self._grads[mb] = self.comm.irecv(np.empty(self.shape, self.grad_dtype), self.reader, GRAD_TAG0 + mb,
                                              "tied weight")

    def send_grad(self, mb: int, grad) -> None:
        """Reader: micro-batch ``mb``'s gradient contribution."""
        if self.local:
            self._grads[mb] = grad.astype(self.grad_dtype, copy=True)
            return
        grad = grad.astype(self.grad_dtype, copy=False)
        self.comm.isend(np.ascontiguousarray(grad) if isinstance(grad, np.ndarray) else grad, self.owner,
                        GRAD_TAG0 + mb, "tied weight")

    def grad(self, mb: int) -> np.ndarray:
        """Owner: the reader's contribution of micro-batch ``mb`` (waits for it)."""
        got = self._grads.pop(mb)
        if self.local:
            return got
        return self.comm.wait(got, f"pipeline: the tied weight's gradient of micro-batch {mb} from stage {self.reader}")
