"""Where the optimizer state lives: the rows of the fp32 master and the Adam moments, and stage 3's
stored parameter shard, behind one small interface.

- :class:`ArrayRows` keeps the three rows as arrays: on the device (no offload), or in host
  memory (``offload_optimizer="cpu"``, pinned when the device is a GPU).
- :class:`FileRows` keeps them in one preallocated file per rank under ``offload_dir``
  (``"nvme"``) and streams them bucket by bucket through three sets of host buffers: a
  background thread reads the next bucket's rows while the current one is updated and
  writes the previous one back (``os.preadv`` / ``os.pwritev``, no copies), so the resident
  optimizer memory is three buckets' rows, not 12 Psi / N.
- :class:`ParamFile` keeps stage 3's stored parameter shard in a file (``offload_params="nvme"``).

The files are files.OffloadFile: every read checked against what was written, a failure an
OffloadError naming the file, the record (row and bucket) and the step. A record is one
bucket's slice of one row; whole-row reads and writes go record by record.
"""
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence, Tuple

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
    """The three rows as whole arrays, made by ``alloc(n)`` (the ledger's, on ``place``)."""

    streamed = False

    def __init__(self, alloc, n: int, place: str):
        self.place = place
        self.rows = {name: alloc(n) for name in ROW_NAMES}

    def begin(self, slices: List[slice]) -> None:
        pass

    def at_step(self, step: int) -> None:
        pass

    def fetch(self, sl: slice) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        return tuple(self.rows[name][sl] for name in ROW_NAMES)

    def commit(self, sl: slice) -> None:
        pass

    def end(self) -> None:
        pass

    def read(self, name: str, sl: slice = slice(None)):
        """Part of a row, as the array's own slice (device or host)."""
        return self.rows[name][sl]

    def write(self, name: str, sl: slice, values) -> None:
        self.rows[name][sl] = values

    def close(self) -> None:
        self.rows = {}


class FileRows:
    """The three rows in one file (row-major), streamed through three sets of host buffers.

    ``slices``: the buckets' shard slices in order (the records; the row is their union);
    ``alloc(n)``: a host float32 array (the ledger's, counted under "buffers" on the host); one
    set of buffers per bucket when there are fewer than three (streaming needs several buckets)."""

    streamed = True

    def __init__(self, directory: str, name: str, slices: Sequence[slice], alloc, rank: int):
        self.place = "disk"
        self.slices = list(slices)
        self.n = n = self.slices[-1].stop if self.slices else 0
        self.file = OffloadFile(directory, name, 3 * 4 * n, rank)
        largest = max((sl.stop - sl.start for sl in self.slices), default=0)
        sets = max(1, min(3, len(self.slices)))
        self._sets = [[alloc(largest) for _ in ROW_NAMES] for _ in range(sets)]
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerompi-offload")
        self._free = list(range(sets))
        self._pending: Dict[int, object] = {}   # buffer set -> the future that must finish before reuse
        self._reads: Dict[Tuple[int, int], Tuple[int, object]] = {}   # slice -> (set, read future)
        self._order: List[slice] = []
        self._lock = threading.Lock()           # the moments start as the file's zeros (a record never written)

    # ---- the step: slices in order, one read ahead ----------------------------------------
    def at_step(self, step: int) -> None:
        self.file.step = step

    def begin(self, slices: List[slice]) -> None:
        self._order = list(slices)
        if self._order:
            self._read_ahead(self._order[0])

    def _key(self, sl: slice) -> Tuple[int, int]:
        return (sl.start, sl.stop)

    def _take_set(self) -> int:
        if not self._free:                     # wait for the oldest write-back to release its set
            s, fut = next(iter(self._pending.items()))
            fut.result()
            del self._pending[s]
            self._free.append(s)
        return self._free.pop(0)

    def _read_ahead(self, sl: slice) -> None:
        s = self._take_set()
        bufs = [b[:sl.stop - sl.start] for b in self._sets[s]]
        self._reads[self._key(sl)] = (s, self._io.submit(self._read_rows, sl, bufs))

    def _where(self, r: int, sl: slice) -> Tuple[int, str]:
        """(data byte offset, the record's name) of row r's slice ``sl`` (one record)."""
        b = next((i for i, x in enumerate(self.slices) if x.start == sl.start), None)
        return 4 * (r * self.n + sl.start), f"{ROW_NAMES[r]} of bucket {b} (elements {sl.start:,}..{sl.stop:,})"

    def _read_rows(self, sl: slice, bufs) -> None:
        for r, buf in enumerate(bufs):
            self.file.read(buf, *self._where(r, sl))

    def fetch(self, sl: slice):
        """The rows of ``sl`` in host buffers (read ahead), the next slice's read started."""
        key = self._key(sl)
        if key not in self._reads:
            self._read_ahead(sl)
        s, fut = self._reads.pop(key)
        fut.result()
        i = next((j for j, o in enumerate(self._order) if self._key(o) == key), None)
        ahead = i is not None and i + 1 < len(self._order) and self._key(self._order[i + 1]) not in self._reads
        if ahead and len(self._sets) > 1:     # one set: the next read waits for this one's write-back
            self._read_ahead(self._order[i + 1])
        self._current = (key, s)
        return tuple(b[:sl.stop - sl.start] for b in self._sets[s])

    def commit(self, sl: slice) -> None:
        """Write the updated rows of ``sl`` back, in the background; their set is reused after."""
        key, s = self._current
        assert key == self._key(sl)
        bufs = [b[:sl.stop - sl.start] for b in self._sets[s]]
        self._pending[s] = self._io.submit(self._write_rows, sl, bufs)

    def _write_rows(self, sl: slice, bufs) -> None:
        for r, buf in enumerate(bufs):
            self.file.write(buf, *self._where(r, sl))

    def end(self) -> None:
        """Every write-back done (errors raised here, naming the file)."""
        for s, fut in list(self._pending.items()):
            fut.result()
            del self._pending[s]
            self._free.append(s)
        for s, fut in list(self._reads.values()):
            fut.result()
            self._free.append(s)
        self._reads.clear()

    # ---- whole rows (checkpoints, the initial values, gathering the master) ----------------
    def read(self, name: str, sl: slice = slice(None)) -> np.ndarray:
        start, stop, _ = sl.indices(self.n)
        out = np.empty(stop - start, F32)
        r = ROW_NAMES.index(name)
        for _, rec in records(self.slices, sl, self.n):
            self.file.read(out[rec.start - start:rec.stop - start], *self._where(r, rec))
        return out

    def write(self, name: str, sl: slice, values) -> None:
        start, _, _ = sl.indices(self.n)
        values = np.asarray(values, F32).reshape(-1)
        r = ROW_NAMES.index(name)
        for _, rec in records(self.slices, sl, self.n):
            self.file.write(values[rec.start - start:rec.stop - start], *self._where(r, rec))

    def close(self) -> None:
        self._io.shutdown(wait=True)
        self.file.close()


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
