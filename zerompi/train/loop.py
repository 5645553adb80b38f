"""The layer-by-layer training step every built-in model uses, on the public engine API."""
from typing import List, Tuple

import numpy as np


def local_rows(n_rows: int, rank: int, world_size: int) -> slice:
    """This rank's rows of a global batch of n_rows (n_rows must divide by world_size)."""
    per = n_rows // world_size
    return slice(rank * per, (rank + 1) * per)


def micro_batches(x, y, count: int) -> List[Tuple[np.ndarray, np.ndarray]]:
    """Split a rank's rows into ``count`` equal micro-batches."""
    per = x.shape[0] // count
    return [(x[i * per:(i + 1) * per], y[i * per:(i + 1) * per]) for i in range(count)]


def run_micro_batch(engine, model, x, y) -> float:
    """Forward, loss and backward of one micro-batch; hands every layer's gradients to the engine.

    ``model`` provides forward_layer(i, params, x) -> (y, cache),
    backward_layer(i, params, cache, dy) -> (dx, grads) and loss(y, target) -> (loss, dy).
    Returns the micro-batch loss (unscaled).
    """
    caches = []
    h = x
    n = engine.layout.num_layers
    engine.begin_forward()       # the visit order, said explicitly: stage 3 prefetches by it
    for i in range(n):
        with engine.unsharded(i) as p:
            h, cache = model.forward_layer(i, p, h)
        caches.append(cache)
    loss, dy = model.loss(h, y)
    dy = dy * np.float32(engine.loss_scale)
    engine.begin_backward()
    for i in reversed(range(n)):
        with engine.unsharded(i) as p:
            dy, grads = model.backward_layer(i, p, caches[i], dy)
        caches[i] = None
        engine.grads_ready(i, grads)
    return loss
