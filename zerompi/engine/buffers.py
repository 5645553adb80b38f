"""The engine's transient bucket buffers: how many are live at once, and how they are pooled.

Stages 2/3 stage each bucket's local gradients until its reduce-scatter is retired, and
stage 3 gathers whole parameter buckets; both are bucket-sized buffers the engine takes
and gives back many times a step. :class:`BucketPool` keeps them, so that after the first
step none is allocated or freed (a fresh one is paged in, zeroed by the kernel, on first
touch); :func:`buffer_classes` decides which bucket lengths share buffers, and
:func:`buffer_counts` how many are live at once (the estimate uses both).
"""
from typing import Dict, List, Mapping, Tuple

import numpy as np


def buffer_counts(stage: int, buckets: int, pending: int, ahead: int) -> Tuple[int, int]:
    """(gradient staging buffers, stage-3 gathered buffers) a rank holds live at once, at most.

    ``pending``: reduce-scatters still in flight when the next bucket's gradients arrive
    (MAX_PENDING_REDUCES; 0 when each is done first). ``ahead``: stage-3 buckets gathered
    ahead of the layer in use (0 with overlap off). Layers the caller holds unsharded beyond
    the visit in progress (the GPT's embedding through its forward) come on top.
    """
    # Stages 2/3: a bucket's staging buffer lives from its first layer's grads_ready until
    # its reduction is retired, and GradientReducer._start waits for the oldest only once the filling
    # bucket is complete: the pending ones and the one filling.
    staged = min(pending + 1, buckets) if stage >= 2 else 0
    # Stage 3: the window of the layer in use (phase.prefetch_window: 1 + ahead buckets).
    gathered = min(1 + ahead, buckets) if stage == 3 else 0
    return staged, gathered


def buffer_classes(lengths: Mapping[int, int], staged: int, gathered: int) -> Dict[int, int]:
    """How the engine pools bucket buffers: {bucket length: elements of the buffers that serve it}.

    ``lengths``: {padded bucket elements: buckets of that length}; ``staged``/``gathered``:
    the most staging and stage-3 gathered buffers live at once (:func:`buffer_counts`).

    The pool's rule (:meth:`BucketPool.take` / :meth:`BucketPool.give`): bucket lengths fall
    into classes of neighbouring lengths; every buffer of a class has the class's longest
    length, and a shorter bucket uses its first elements. A released buffer is kept for its
    class until close, and one is allocated only when its class has none spare. So a class
    holds as many buffers as it ever had live at once (its high-water mark): once a step has
    reached that, no bucket buffer is allocated or freed again. It is at most
    min(buckets in the class, staged) + min(buckets in the class, gathered).

    Why classes: keyed by exact length, a spare serves only its own length, so never
    allocating again would keep a set of buffers per length (every bucket of another length:
    the whole model, twice at stage 3); one class would make every buffer as long as the
    longest bucket. The grouping chosen is the one whose bound -- the sum over classes of
    its length times that count -- is least (ties keep lengths apart). With one bucket
    length that is the live buffers and nothing more.
    """
    sizes = sorted(lengths)                   # a class is a run sizes[j:i]
    bound = lambda size, count: size * (min(count, staged) + min(count, gathered))
    best, first = [0], [0]                    # for sizes[:i]: the least bound, where its last class starts
    for i in range(1, len(sizes) + 1):
        options, count = [], 0
        for j in range(i - 1, -1, -1):        # the last class is sizes[j:i]
            count += lengths[sizes[j]]
            if count >= max(staged, gathered):
                j = 0                         # its bound stops growing, and best[] only shrinks towards 0
            options.append((best[j] + bound(sizes[i - 1], count), -j))
            if j == 0:
                break
        cost, j = min(options)                # on a tie, the shortest last class
        best.append(cost)
        first.append(-j)
    out, i = {}, len(sizes)
    while i > 0:
        out.update((n, sizes[i - 1]) for n in sizes[first[i]:i])
        i = first[i]
    return out


def plan_classes(layout, config, max_pending: int) -> Dict[int, int]:
    """The pool's classes for ``layout``, sized for the most buffers the schedule of ``config``
    holds at once (``max_pending``: reductions in flight, the reducer's cap)."""
    lengths: Dict[int, int] = {}
    for bucket in layout.buckets:
        lengths[bucket.numel] = lengths.get(bucket.numel, 0) + 1
    staged, gathered = buffer_counts(config.stage, len(layout.buckets), max_pending if config.overlap else 0,
                                     config.prefetch if config.overlap else 0)
    return buffer_classes(lengths, staged, gathered)


class BucketPool:
    """Bucket buffers by class (``classes``: bucket length -> elements of its buffers),
    allocated through the engine's memory ledger (counted under "buffers") and kept for
    reuse until :meth:`clear`."""

    def __init__(self, ledger, dtype, classes: Mapping[int, int]):
        self.ledger, self.dtype, self.classes = ledger, dtype, dict(classes)
        self._spare: Dict[int, List[np.ndarray]] = {}   # class size -> released buffers

    def take(self, numel: int) -> np.ndarray:
        """A buffer of ``numel`` elements: the first ``numel`` of a spare one of its class, or a
        new one when none is spare (a fresh array is paged in on first touch; a reused one is not)."""
        size = self.classes.get(numel, numel)
        spare = self._spare.get(size)
        buf = spare.pop() if spare else self.ledger.alloc("buffers", size, self.dtype, zero=False)
        return buf if size == numel else buf[:numel]

    def give(self, buf) -> None:
        """Keep a buffer for reuse by its class. Nothing is freed: a class holds as many buffers
        as it ever had live at once, so once a step has reached that, none is allocated again."""
        whole = buf if buf.base is None else buf.base   # take() lent a prefix of it
        self._spare.setdefault(whole.size, []).append(whole)

    def clear(self) -> None:
        """Drop the spare buffers (the engine's close)."""
        self._spare.clear()
