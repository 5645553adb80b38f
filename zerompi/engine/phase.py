"""The phase of one training step (forward, backward, ...), the order in which it visits
layers, and the stage-3 prefetch window. (A pipeline's schedule, the order of whole forwards
and backwards of micro-batches over stages, is another thing: zerompi/pipeline/.)

One micro-batch visits layers 0, 1, ..., L-1 (forward) then L-1, ..., 0 (backward); when
another micro-batch of the same step follows, its forward comes next. Knowing where it is
in that sequence, the engine can gather the buckets the next visits read while the
current layer computes, and free the ones no upcoming visit needs. The sequence is
explicit (the loop says ``begin_forward``/``begin_backward``); without those hints the
direction is inferred from the order of ``unshard`` calls.
"""
from enum import Enum
from typing import Iterator, List, Optional, Sequence


class Phase(Enum):
    """Where a rank is in its training step (also the timer it charges)."""
    IDLE = "idle"              # between micro-batches or steps (data, loss, logging)
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"    # inside step()


def visits_after(layer: int, phase: Phase, num_layers: int, more_micro_batches: bool) -> Iterator[int]:
    """The layers this rank will unshard after the current visit of ``layer``, in order.

    In the forward: the rest of the forward, then the whole backward. In the backward:
    the rest of the backward, then the next micro-batch's forward if one follows.
    """
    if phase is Phase.FORWARD:
        yield from range(layer + 1, num_layers)
        yield from range(num_layers - 1, -1, -1)
    else:
        yield from range(layer - 1, -1, -1)
        if more_micro_batches:
            yield from range(num_layers)


def prefetch_window(current: Optional[int], upcoming: Iterator[int], layer_bucket: Sequence[int],
                    depth: int) -> List[int]:
    """Buckets to hold gathered: the current layer's bucket (if any), then the next ``depth``
    distinct buckets the upcoming visits read, in the order they will be needed.

    Its length is at most 1 + depth: the bound on gathered buckets alive at once.
    """
    window = [] if current is None else [layer_bucket[current]]
    limit = len(window) + depth
    for layer in upcoming:
        if len(window) >= limit:
            break
        b = layer_bucket[layer]
        if b not in window:
            window.append(b)
    return window


def infer_phase(phase: Phase, last_layer: Optional[int], layer: int) -> Phase:
    """The phase implied by unsharding ``layer`` after ``last_layer`` (when the loop gives no hint).

    Only monotone evidence changes it: a lower layer during the forward means the backward
    has begun, a higher one during the backward means a new forward. Repeating the same
    layer (the forward/backward turn) keeps the phase.
    """
    if phase in (Phase.IDLE, Phase.OPTIMIZER) or last_layer is None:
        return Phase.FORWARD
    if phase is Phase.FORWARD and layer < last_layer:
        return Phase.BACKWARD
    if phase is Phase.BACKWARD and layer > last_layer:
        return Phase.FORWARD
    return phase
