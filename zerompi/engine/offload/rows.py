"""Where the optimizer state lives: the rows of the fp32 master and the Adam moments, and stage 3's
stored parameter shard, behind one small interface.

- :class:`ArrayRows` keeps the three rows as arrays: on the device (no offload), or in host
  memory (``offload_optimizer="cpu"``, pinned when the device is a GPU).
- :class:`stream.FileRows` keeps them in one preallocated file per rank under ``offload_dir``
  (``"nvme"``), two generations, and streams them bucket by bucket through a few sets of
  host buffers (read ahead, in update, written behind), so the resident optimizer memory is
  a few buckets' rows, not 12 Psi / N.
- :class:`ParamFile` keeps stage 3's stored parameter shard in a file (``offload_params="nvme"``).

Both offer one pass's interface: ``plan`` (the order), ``fetch`` (a bucket's rows), ``put``
(written back), ``commit`` (they are the current rows), ``drain``. The files are
files.OffloadFile: every read checked against what was written, a failure an OffloadError
naming the file, the record (row and bucket) and the step. A record is one bucket's slice of
one row; whole-row reads and writes go record by record.
"""
from typing import Optional, Sequence, Tuple

import numpy as np

from .files import OffloadFile

F32 = np.float32
ROW_NAMES = ("master", "exp_avg", "exp_avg_sq")


def records(slices: Sequence[slice], sl: slice, n: int):
    """The record slices (of ``slices``, the buckets' shard slices in order) that make up ``sl`` of a
    row of ``n`` elements; ``sl`` must be a run of whole records."""
    start, stop, _ = sl.indices(n)
    inside = [(i, r) for i, r in enumerate(slices) if start <= r.start and r.stop <= stop and r.start < r.stop]
    assert sum(r.stop - r.start for _, r in inside) == stop - start, (sl, slices)
    return inside


class ArrayRows:
    """The rows (``names``: AdamW's three by default) as whole arrays, made by ``alloc(n)`` (the ledger's,
    on ``place``)."""

    streamed = False

    def __init__(self, alloc, n: int, place: str, names: Sequence[str] = ROW_NAMES):
        self.place, self.names = place, tuple(names)
        self.rows = {name: alloc(n) for name in self.names}

    def at_step(self, step: int) -> None:
        pass

    def plan(self, slices: Sequence[slice]) -> None:
        pass

    def fetch(self, sl: slice) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The rows of ``sl``: the arrays' own slices, updated in place."""
        return tuple(self.rows[name][sl] for name in self.names)

    def put(self, sl: slice) -> None:
        pass

    def commit(self, slices: Sequence[slice]) -> None:
        pass

    def drain(self) -> None:
        pass

    def read(self, name: str, sl: slice = slice(None)):
        """Part of a row, as the array's own slice (device or host)."""
        return self.rows[name][sl]

    def write(self, name: str, sl: slice, values) -> None:
        self.rows[name][sl] = values

    def close(self) -> None:
        self.rows = {}


class ParamFile:
    """Stage 3's stored parameter shard in a file (``offload_params="nvme"``), a record per bucket
    (``slices``: the buckets' shard slices in order)."""

    def __init__(self, directory: str, name: str, slices: Sequence[slice], dtype, rank: int):
        self.dtype, self.slices = np.dtype(dtype), list(slices)
        self.n = self.slices[-1].stop if self.slices else 0
        self.file = OffloadFile(directory, name, self.n * self.dtype.itemsize, rank)

    def at_step(self, step: int) -> None:
        self.file.step = step

    def _records(self, sl: slice):
        for b, rec in records(self.slices, sl, self.n):
            yield rec, rec.start * self.dtype.itemsize, f"params of bucket {b} (elements {rec.start:,}..{rec.stop:,})"

    def read(self, sl: slice, out: Optional[np.ndarray] = None) -> np.ndarray:
        start, stop, _ = sl.indices(self.n)
        out = np.empty(stop - start, self.dtype) if out is None else out
        for rec, offset, what in self._records(sl):
            self.file.read(out[rec.start - start:rec.stop - start], offset, what)
        return out

    def write(self, sl: slice, values) -> None:
        start, _, _ = sl.indices(self.n)
        values = np.asarray(values, self.dtype).reshape(-1)
        for rec, offset, what in self._records(sl):
            self.file.write(values[rec.start - start:rec.stop - start], offset, what)

    def close(self) -> None:
        self.file.close()
