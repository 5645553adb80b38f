"""A rank's rows of a batch, its micro-batches, and one micro-batch of any layered model through the engine."""
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
    """Forward, loss and backward of one micro-batch through all of the engine's layers (models/chunks.py's
    walk); hands every layer's gradients to the engine. ``model`` provides forward_layer(i, params, x) ->
    (y, cache), backward_layer(i, params, cache, dy) -> (dx, grads) and loss(y, target) -> (loss, dy).
    Returns the micro-batch loss (unscaled)."""
    from .models.chunks import Chunk
    n = engine.layout.num_layers
    chunk = Chunk(model, range(n), n).attach(engine)
    chunk.batches = [(x, y)]
    return chunk.run()[0]
