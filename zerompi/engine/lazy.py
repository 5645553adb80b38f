"""Lazy parameters: a shape and a deterministic rule instead of an array (DeepSpeed's zero.Init idea).

A model hands the engine, for each parameter, either its whole initial array or a :class:`Lazy`
initializer: its shape and a rule, named and seeded, that makes any run of its values (in the
flattened, row-major order) on demand. The engine then makes only what a rank keeps -- its slice
of every bucket, one bucket at a time (engine/initial.py) -- so no rank ever holds the whole
model, and a stage-3 layer is whole only while it is gathered.

The rules:

- :class:`Constant`: every element one value (LayerNorm gains, biases).
- :class:`Normal`: draws of ``numpy.random.default_rng(seed).standard_normal``, in float64, from
  draw ``offset`` of that generator's stream on, times ``scale`` (or divided by ``divisor``),
  rounded to float32. A model that draws its parameters from one generator in turn gets the
  same values: :class:`Stream` hands out the offsets in the order the parameters are declared.
  NumPy's normals come from a rejection sampler (a draw may use more than one 64-bit number), so
  the stream cannot be entered at an offset without making what comes before it: a rank walks
  the stream once, in order (:class:`Draws`), keeping only its own runs of it.
- :class:`Piece`: one tensor-parallel rank's piece of another rule's parameter (comm/tp_pieces.py's
  ``piece``, made lazily).

``describe()`` names a rule and its numbers (what every rank must agree on); :func:`materialize`
makes whole arrays, as a model that is not lazy would have built them.
"""
from math import prod
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

F32 = np.float32
CHUNK = 1 << 20           # draws made at a time (8 MiB of float64)
KEEP_EVERY = 1 << 24      # a stream's generator state is kept every this many draws: going back costs at most this


class Lazy:
    """A parameter's shape and a rule for its float32 initial values (subclasses say which)."""

    dtype = np.dtype(F32)      # what the engine will store it from (its master is float32)

    def __init__(self, shape):
        self.shape: Tuple[int, ...] = tuple(int(d) for d in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        self.size = prod(self.shape)

    def fill(self, out: np.ndarray, lo: int, hi: int, draws: "Draws") -> None:
        """Write elements ``lo .. hi-1`` of the flattened values into ``out`` (float32, ``hi - lo`` long)."""
        raise NotImplementedError

    def describe(self) -> dict:
        """The rule, by name, with its seed and numbers (JSON-able)."""
        raise NotImplementedError

    def materialize(self, draws: Optional["Draws"] = None) -> np.ndarray:
        """The whole parameter as a float32 array of its shape."""
        out = np.empty(self.size, F32)
        self.fill(out, 0, self.size, draws or Draws())
        return out.reshape(self.shape)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()})"


class Constant(Lazy):
    def __init__(self, shape, value: float):
        super().__init__(shape)
        self.value = float(value)

    def fill(self, out, lo, hi, draws) -> None:
        out[:hi - lo] = self.value

    def describe(self) -> dict:
        return {"init": "constant", "shape": list(self.shape), "value": self.value}


class Normal(Lazy):
    """float32(z * scale), or float32(z / divisor), for z the draws ``offset ..`` of default_rng(seed)."""

    def __init__(self, shape, seed, offset: int = 0, scale: Optional[float] = None, divisor: Optional[float] = None):
        super().__init__(shape)
        if (scale is None) == (divisor is None):
            raise ValueError("give Normal a scale or a divisor (one of the two)")
        self.seed = tuple(int(s) for s in seed) if isinstance(seed, (tuple, list)) else int(seed)
        self.offset, self.scale, self.divisor = int(offset), scale, divisor

    def fill(self, out, lo, hi, draws) -> None:
        z = draws.scratch()
        for a in range(lo, hi, CHUNK):
            m = min(CHUNK, hi - a)
            draws.take(self.seed, self.offset + a, z[:m])
            if self.divisor is not None:
                np.divide(z[:m], self.divisor, out=z[:m])
            else:
                np.multiply(z[:m], self.scale, out=z[:m])
            out[a - lo:a - lo + m] = z[:m]            # float64 -> float32, rounded as astype rounds

    def describe(self) -> dict:
        how = {"divisor": float(self.divisor)} if self.divisor is not None else {"scale": float(self.scale)}
        seed = list(self.seed) if isinstance(self.seed, tuple) else self.seed
        return {"init": "normal", "shape": list(self.shape), "seed": seed, "offset": self.offset, **how}


class Stream:
    """One generator's normals handed out in turn: ``normal(shape, ...)`` takes the next draws, as
    ``rng.standard_normal(shape)`` would on ``rng = numpy.random.default_rng(seed)``."""

    def __init__(self, seed):
        self.seed, self.drawn = seed, 0

    def normal(self, shape, scale: Optional[float] = None, divisor: Optional[float] = None) -> Normal:
        p = Normal(shape, self.seed, self.drawn, scale, divisor)
        self.drawn += p.size
        return p


class Piece(Lazy):
    """TP rank ``rank`` of ``size``'s piece of ``whole``: cut along ``axis`` into ``groups`` parts, each
    part into ``size`` (as comm/tp_pieces.piece cuts an array)."""

    def __init__(self, whole: Lazy, axis: int, groups: int, rank: int, size: int):
        length = whole.shape[axis]
        if length % (groups * size):
            raise ValueError(f"axis {axis} of {whole.shape} does not split into {groups} x {size} pieces")
        shape = list(whole.shape)
        shape[axis] = length // size
        super().__init__(shape)
        self.whole, self.axis, self.groups, self.rank, self.tp = whole, int(axis), int(groups), int(rank), int(size)

    def _sources(self, lo: int, hi: int) -> np.ndarray:
        """Flat indices into the whole parameter of the piece's elements lo .. hi-1 (increasing)."""
        idx = list(np.unravel_index(np.arange(lo, hi, dtype=np.int64), self.shape))
        per = self.shape[self.axis] // self.groups          # a group's piece along the axis
        j = idx[self.axis]
        idx[self.axis] = (j // per) * per * self.tp + self.rank * per + j % per
        return np.ravel_multi_index(idx, self.whole.shape)

    def fill(self, out, lo, hi, draws) -> None:
        step = max(1, CHUNK // self.tp)
        for a in range(lo, hi, step):
            b = min(hi, a + step)
            src = self._sources(a, b)
            first = int(src[0])
            span = np.empty(int(src[-1]) + 1 - first, F32)   # the whole's run that holds them
            self.whole.fill(span, first, first + span.size, draws)
            out[a - lo:b - lo] = span[src - first]

    def describe(self) -> dict:
        return {"init": "piece", "shape": list(self.shape), "of": self.whole.describe(), "axis": self.axis,
                "groups": self.groups, "rank": self.rank, "size": self.tp}


class Draws:
    """Cursors into the generators' streams for one construction (``fill`` calls share it): asked in
    increasing order, every draw is made once; going back restarts from a kept state (at most
    KEEP_EVERY draws before)."""

    def __init__(self):
        self._cursors: Dict[object, list] = {}      # seed -> [generator, position, {position: state}]
        self._scratch = None

    def scratch(self) -> np.ndarray:
        """A float64 buffer of CHUNK draws for a fill (one construction fills one parameter at a time)."""
        if self._scratch is None:
            self._scratch = np.empty(CHUNK, np.float64)
        return self._scratch

    def take(self, seed, start: int, out: np.ndarray) -> None:
        """Draws ``start .. start + len(out) - 1`` of default_rng(seed)'s normals into ``out`` (float64)."""
        cur = self._cursors.get(seed)
        if cur is None:
            rng = np.random.default_rng(list(seed) if isinstance(seed, tuple) else seed)
            cur = self._cursors[seed] = [rng, 0, {0: rng.bit_generator.state}]
        if start < cur[1]:                           # back to the last kept state before start
            at = max(p for p in cur[2] if p <= start)
            cur[0].bit_generator.state, cur[1] = cur[2][at], at
        skip = np.empty(min(CHUNK, max(start - cur[1], 1)), np.float64)
        while cur[1] < start:
            self._advance(cur, skip[:self._step(cur, start)])
        done = 0
        while done < out.size:
            m = self._step(cur, cur[1] + out.size - done)
            self._advance(cur, out[done:done + m])
            done += m

    @staticmethod
    def _step(cur, target: int) -> int:
        """Draws to make next: up to target, CHUNK at most, never past the next kept state."""
        nxt = (cur[1] // KEEP_EVERY + 1) * KEEP_EVERY
        return min(CHUNK, target - cur[1], nxt - cur[1])

    @staticmethod
    def _advance(cur, into: np.ndarray) -> None:
        cur[0].standard_normal(out=into)
        cur[1] += into.size
        if cur[1] % KEEP_EVERY == 0:
            cur[2][cur[1]] = cur[0].bit_generator.state


def is_lazy(value) -> bool:
    return isinstance(value, Lazy)


def materialize(layers: Sequence[Tuple[str, dict]]) -> List[Tuple[str, Dict[str, np.ndarray]]]:
    """[(layer, {name: whole float32 array})] of layers whose values are arrays or Lazy rules (one
    walk of each stream, in order)."""
    draws = Draws()
    return [(lname, {n: v.materialize(draws) if is_lazy(v) else v for n, v in params.items()})
            for lname, params in layers]
