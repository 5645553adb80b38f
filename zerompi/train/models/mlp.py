"""MLP regression: ``depth`` blocks of Linear(width, width) + GELU (none after the last block),
trained with MSE to the outputs of a fixed random teacher of the same shape."""
from typing import List

import numpy as np

from ...engine import lazy
from .. import loop
from ..model_kernels import upcast
from .chunks import Chunk

F32 = np.float32
_C = F32(np.sqrt(2.0 / np.pi))   # a float32 scalar keeps float32 arrays float32 (NEP 50)


def gelu(x):
    """tanh-approximate GELU, elementwise, in the dtype of x."""
    # x * x * x, not x ** 3: the power ufunc is hundreds of times slower on float32.
    return F32(0.5) * x * (F32(1.0) + np.tanh(_C * (x + F32(0.044715) * (x * x * x))))


def gelu_grad(x):
    """d gelu / dx at x."""
    u = _C * (x + F32(0.044715) * (x * x * x))
    t = np.tanh(u)
    return F32(0.5) * (F32(1.0) + t) + F32(0.5) * x * (F32(1.0) - t * t) * _C * (F32(1.0) + F32(3 * 0.044715) * x * x)


def lazy_mlp(width: int, depth: int, seed: int):
    """[(layer name, {param name: lazy rule})] (engine/lazy.py): W ~ N(0, 1/width), drawn in turn from
    one generator, b = 0."""
    stream = lazy.Stream(seed)
    return [(f"block{i}", {f"block{i}.weight": stream.normal((width, width), divisor=np.sqrt(width)),
                           f"block{i}.bias": lazy.Constant(width, 0.0)}) for i in range(depth)]


def init_mlp(width: int, depth: int, seed: int):
    """lazy_mlp() made whole: [(layer name, {param name: float32 array})]."""
    return lazy.materialize(lazy_mlp(width, depth, seed))


class MLP:
    """Hand-written forward/backward of one block at a time, float32 compute on stored parameters."""

    def __init__(self, width: int, depth: int, seed: int = 0):
        self.width, self.depth, self.seed = width, depth, seed

    def lazy_layers(self):
        """The parameters as lazy rules: the engine makes each rank's shard of them."""
        return lazy_mlp(self.width, self.depth, self.seed)

    def init_layers(self):
        return init_mlp(self.width, self.depth, self.seed)

    def _weight(self, params, i):
        """Layer i's weight in float32; a stored fp16 one converted into one buffer every layer shares."""
        w = params[f"block{i}.weight"]
        if w.dtype != F32 and isinstance(w, np.ndarray):
            self._w32 = upcast(w, F32, getattr(self, "_w32", None))
            return self._w32
        return w.astype(F32, copy=False)

    def forward_layer(self, i, params, x):
        """y = gelu(x @ W + b) (no GELU after the last block); returns (y, cache)."""
        w = self._weight(params, i)
        b = params[f"block{i}.bias"].astype(F32, copy=False)
        z = x @ w + b
        if i == self.depth - 1:
            return z, (x, None)
        return gelu(z), (x, z)

    def backward_layer(self, i, params, cache, dy):
        """(dx, {param name: grad}) for upstream dy; dx None for layer 0 (nothing reads the data's gradient)."""
        dx, weights = self.backward_layer_parts(i, params, cache, dy)
        return dx, weights()

    def backward_layer_parts(self, i, params, cache, dy):
        """(dx, weights): ``weights()`` -> {param name: grad} later (a zero-bubble schedule's B, then W)."""
        x, z = cache
        dz = dy if z is None else dy * gelu_grad(z)
        w = self._weight(params, i)
        return (dz @ w.T if i else None), lambda: {f"block{i}.weight": x.T @ dz, f"block{i}.bias": dz.sum(axis=0)}

    def activation_spec(self, i: int, rows: int):
        """(shape, dtype) of block i's output for ``rows`` rows (the input of block i + 1)."""
        return (rows, self.width), F32

    @staticmethod
    def loss(y, target):
        """Mean squared error over every element of the micro-batch; returns (loss, dloss/dy)."""
        diff = y - target
        return float(np.mean(diff.astype(np.float64) ** 2)), (2.0 / diff.size) * diff


TEACHER_BLOCK = 16    # rows per teacher matrix multiply


class TeacherData:
    """Inputs x ~ N(0, 1) (step s: one generator's draws (seed, s), row after row) and float32 targets from a fixed
    random teacher MLP, TEACHER_BLOCK rows per matrix multiply: a BLAS may round a row differently at another
    height, so a target depends on (seed, s, j) only, not on the batch, the world size or the rank."""

    def __init__(self, width: int, depth: int, seed: int):
        self.width, self.seed = width, seed
        rng = np.random.default_rng(seed + 7)
        self.teacher = [(p[f"block{i}.weight"], (rng.standard_normal(width) * 0.1).astype(F32))
                        for i, (_, p) in enumerate(init_mlp(width, depth, seed + 1_000_003))]

    def _targets(self, x):
        """The teacher's outputs for x, one block of rows per matrix multiply, layer by layer (a weight read once)."""
        hs = [x[k:k + TEACHER_BLOCK] for k in range(0, len(x), TEACHER_BLOCK)]
        for i, (w, b) in enumerate(self.teacher):
            for k, h in enumerate(hs):
                h = h @ w
                h += b
                hs[k] = gelu(h) if i < len(self.teacher) - 1 else h
        return np.concatenate(hs)

    def rows(self, step: int, rows: range):
        """(x, y) of rows ``rows`` (global indices) of step ``step``: float32 (len(rows), width) each."""
        if not len(rows):
            return np.empty((0, self.width), F32), np.empty((0, self.width), F32)
        first, stop = rows.start // TEACHER_BLOCK, -(-rows.stop // TEACHER_BLOCK)
        x = np.random.default_rng([self.seed, step]).standard_normal((stop * TEACHER_BLOCK, self.width))
        x = x[first * TEACHER_BLOCK:].astype(F32)
        y = self._targets(x)
        lo = rows.start - first * TEACHER_BLOCK
        return x[lo:lo + len(rows)], y[lo:lo + len(rows)]

    def global_batch(self, step: int, batch: int):
        """(x, y) of the whole global batch of ``step`` (rows 0 .. batch-1)."""
        return self.rows(step, range(batch))


def step_batches(data: TeacherData, step: int, batch: int, share: int, shares: int, micro_batches: int, xp=np):
    """[(x, y)] of the micro-batches of share ``share`` of ``shares`` of step ``step``'s ``batch`` rows, made on the
    host and moved to ``xp`` (CuPy for --device gpu, to which the model's NumPy calls dispatch)."""
    rows = loop.local_rows(batch, share, shares)
    x, y = data.rows(step, range(rows.start, rows.stop))
    return [(xp.asarray(xm), xp.asarray(ym)) for xm, ym in loop.micro_batches(x, y, micro_batches)]


def train_losses(engine, model: MLP, data: TeacherData, step: int, batch: int, micro_batches: int) -> List[float]:
    """This rank's micro-batch losses of step ``step`` (``batch`` rows over all ranks) through one chunk of all."""
    chunk = Chunk(model, range(model.depth), model.depth).attach(engine)
    chunk.batches = step_batches(data, step, batch, engine.rank, engine.world_size, micro_batches, engine.xp)
    return chunk.run()
