"""The optimizer's rows in a file, streamed bucket by bucket through a bounded set of host buffers.

:class:`FileRows` keeps the fp32 master and the two Adam moments of this rank's shard in one
offload file (files.OffloadFile), **two generations** of them: a bucket's rows are read from
its current generation and the updated rows written to the other one, which becomes current
only when :meth:`FileRows.commit` says so. An update that must be taken back (the step is
skipped, or it ran before the step knew its clip factor or learning rate and guessed wrong:
engine/in_backward.py) is then simply never committed: nothing was overwritten.

The rows travel through ``sets`` sets of host buffers (three rows of the largest bucket slice
each) in a pipeline run by one I/O thread: :meth:`plan` names the order of the next pass and
starts reading ahead into every free set; :meth:`fetch` hands a bucket's rows over once read;
:meth:`put` writes them behind, and the set, once written, takes the next read. Reads and
writes run in the order they were asked for, so a read that follows a write of the same rows
sees them. Whole-row reads and writes (checkpoints, the initial values, gathering the
master) wait for the pipeline to drain first.
"""
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Sequence, Tuple

import numpy as np

from .files import ALIGN, OffloadFile
from .rows import F32, ROW_NAMES, records

SETS = 4       # buffer sets: rows read ahead while one bucket is updated and another written behind


def padded(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of ALIGN (a record's room in the file, a buffer's length)."""
    return -(-nbytes // ALIGN) * ALIGN


def file_bytes(slices: Sequence[slice], generations: int) -> int:
    """The data bytes of a FileRows file for these bucket slices: every record's padded room."""
    return generations * 3 * sum(padded(4 * (sl.stop - sl.start)) for sl in slices)


def aligned_array(alloc, numel: int) -> np.ndarray:
    """A float32 array of ``numel`` (a multiple of ALIGN / 4) starting at an ALIGN-byte boundary, cut from
    a slightly longer one made by ``alloc`` (O_DIRECT needs aligned buffers)."""
    raw = alloc(numel + ALIGN // 4)
    skip = (-raw.ctypes.data % ALIGN) // 4
    return raw[skip:skip + numel]


class FileRows:
    """The three rows of ``slices`` (the buckets' shard slices, in order) in a file, in two
    ``generations`` (one: the rows are rewritten in place and an update cannot be taken back).

    ``alloc(n)``: a host float32 array (the ledger's, counted under "buffers" on the host); fewer
    sets than ``sets`` when there are fewer buckets (streaming needs several)."""

    streamed = True

    def __init__(self, directory: str, name: str, slices: Sequence[slice], alloc, rank: int, generations: int = 2,
                 direct: bool = True, sets: int = SETS):
        self.place = "disk"
        self.slices = list(slices)
        self.n = self.slices[-1].stop if self.slices else 0
        self.spare = generations == 2            # a second generation: an update can be taken back
        self._offsets = {}                       # (generation, row, bucket) -> the record's data offset
        at = 0
        for key in ((g, r, b) for g in range(generations) for r in range(3) for b in range(len(self.slices))):
            self._offsets[key] = at
            at += padded(4 * (self.slices[key[2]].stop - self.slices[key[2]].start))   # records ALIGN apart
        self.file = OffloadFile(directory, name, at, rank, direct)
        self.gen = [0] * len(self.slices)        # the generation holding each bucket's current rows
        self._index = {(sl.start, sl.stop): b for b, sl in enumerate(self.slices)}
        largest = padded(4 * max((sl.stop - sl.start for sl in self.slices), default=0)) // 4
        k = max(1, min(sets, len(self.slices)))
        self._sets = [[aligned_array(alloc, largest) for _ in ROW_NAMES] for _ in range(k)]
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerompi-offload-io")
        self._cond = threading.Condition()
        self._free = deque(range(k))             # buffer sets holding nothing
        self._queue: deque = deque()             # buckets to read next, in the planned order
        self._reads: Dict[int, Tuple[int, object]] = {}   # bucket -> (set, its read's future)
        self._held: Dict[int, int] = {}          # bucket -> set: fetched, being updated
        self._writing = 0                        # write-behinds not yet done
        self._order: Dict[int, int] = {}         # bucket -> its place in the planned order
        self._error = None                       # the first I/O error, raised at the next call

    def _bucket(self, sl: slice) -> int:
        """The bucket whose shard slice is ``sl``."""
        return self._index[(sl.start, sl.stop)]

    def at_step(self, step: int) -> None:
        self.file.step = step

    # ---- the pipeline ------------------------------------------------------------------
    def plan(self, slices: Sequence[slice]) -> None:
        """The bucket slices the next pass updates, in order: read ahead into every free set now.
        Buckets already read ahead stay read."""
        order = [self._bucket(sl) for sl in slices]
        with self._cond:
            self._order = {b: i for i, b in enumerate(order)}
            self._queue = deque(b for b in order if b not in self._reads and b not in self._held)
            self._fill()

    def _rank(self, b: int) -> int:
        """Where bucket b comes in the planned order (unplanned: last)."""
        return self._order.get(b, len(self._order))

    def _fill(self) -> None:                     # under the lock
        while self._free and self._queue:
            b, s = self._queue.popleft(), self._free.popleft()
            self._reads[b] = (s, self._io.submit(self._read_rows, b, s, self.gen[b], self.file.step))

    def _where(self, gen: int, r: int, b: int) -> Tuple[int, str]:
        sl = self.slices[b]
        return self._offsets[(gen, r, b)], f"{ROW_NAMES[r]} of bucket {b} (elements {sl.start:,}..{sl.stop:,})"

    def _bufs(self, s: int, b: int, pad: bool = False):
        """Set s's three buffers as bucket b's rows (``pad``: to the record's padded length, for the I/O)."""
        k = self.slices[b].stop - self.slices[b].start
        k = padded(4 * k) // 4 if pad else k
        return tuple(buf[:k] for buf in self._sets[s])

    def _read_rows(self, b: int, s: int, gen: int, step) -> None:
        """(The I/O thread.) With O_DIRECT the rows are only moved here, and hashed by fetch()'s caller:
        the I/O thread keeps the device busy, and the update reads the rows the hash brought into cache."""
        self.file.for_step(step)
        nbytes = 4 * (self.slices[b].stop - self.slices[b].start)
        for r, buf in enumerate(self._bufs(s, b, pad=True)):
            self.file.read(buf, *self._where(gen, r, b), nbytes, check=not self.file.direct_fd)

    def _write_rows(self, b: int, s: int, gen: int, step, digests) -> None:
        self.file.for_step(step)
        nbytes = 4 * (self.slices[b].stop - self.slices[b].start)
        try:
            for r, buf in enumerate(self._bufs(s, b, pad=True)):
                self.file.write(buf, *self._where(gen, r, b), nbytes, digests[r] if digests else None)
        except BaseException as e:
            self._error = self._error or e
        finally:
            with self._cond:                     # the set takes the next read, written or not
                self._writing -= 1
                self._free.append(s)
                self._fill()
                self._cond.notify_all()

    def fetch(self, sl: slice):
        """The (master, exp_avg, exp_avg_sq) of bucket slice ``sl`` in host buffers, once read (planned or not)."""
        b = self._bucket(sl)
        with self._cond:
            self._raise()
            if b not in self._reads:
                if b in self._queue:
                    self._queue.remove(b)
                self._queue.appendleft(b)        # next in line for a set
                self._fill()
            while b not in self._reads:          # its read waits for a set
                if not self._writing:            # no write-behind will free one: take a read-ahead's
                    self._steal()
                else:
                    self._cond.wait(0.1)
                self._raise()
            s, fut = self._reads.pop(b)
        try:
            fut.result()
            if self.file.direct_fd is not None:          # moved only: checked here (see _read_rows)
                nbytes = 4 * (self.slices[b].stop - self.slices[b].start)
                for r, buf in enumerate(self._bufs(s, b)):
                    self.file.verify(buf, *self._where(self.gen[b], r, b), nbytes)
        except BaseException:
            with self._cond:
                self._free.append(s)
            raise
        self._held[b] = s
        return self._bufs(s, b)

    def _steal(self) -> None:                    # under the lock: the latest planned read gives its set back
        victim = max(self._reads, key=self._rank)
        s, fut = self._reads.pop(victim)
        try:
            fut.result()
        except BaseException:
            pass
        b = self._queue.popleft()
        self._queue.appendleft(victim)
        self._queue.appendleft(b)
        self._free.append(s)
        self._fill()

    def put(self, sl: slice) -> None:
        """Write the updated rows of ``sl`` (fetched) behind, into their other generation (see commit)."""
        b = self._bucket(sl)
        s = self._held.pop(b)
        digests = None
        if self.file.direct_fd is not None:               # hashed here, in cache after the update
            digests = [self.file.digest(buf, buf.nbytes) for buf in self._bufs(s, b)]
        with self._cond:
            self._raise()
            self._writing += 1
        self._io.submit(self._write_rows, b, s, 1 - self.gen[b] if self.spare else 0, self.file.step, digests)

    def commit(self, slices: Sequence[slice]) -> None:
        """The rows last put for ``slices`` become their current rows (their writes may still run:
        every later read is queued behind them)."""
        for sl in slices if self.spare else ():
            b = self._bucket(sl)
            self.gen[b] = 1 - self.gen[b]

    def drain(self) -> None:
        """Every read and write asked for done; the first I/O error raised (naming the file)."""
        with self._cond:
            while self._writing:
                self._cond.wait(0.1)
            reads = [fut for _, fut in self._reads.values()]
        for fut in reads:
            if fut.exception() is not None:
                self._error = self._error or fut.exception()
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _drop_reads(self) -> None:
        """Every read ahead given back and queued again (a whole-row write is about to change the rows)."""
        self.drain()
        with self._cond:
            again = sorted(self._reads, key=self._rank)
            for s, _ in self._reads.values():
                self._free.append(s)
            self._reads.clear()
            self._queue = deque(again + [b for b in self._queue if b not in again])

    # ---- whole rows (checkpoints, the initial values, gathering the master) ----------------
    def read(self, name: str, sl: slice = slice(None)) -> np.ndarray:
        self.drain()
        start, stop, _ = sl.indices(self.n)
        out = np.empty(stop - start, F32)
        r = ROW_NAMES.index(name)
        for b, rec in records(self.slices, sl, self.n):
            self.file.read(out[rec.start - start:rec.stop - start], *self._where(self.gen[b], r, b))
        return out

    def write(self, name: str, sl: slice, values) -> None:
        self._drop_reads()
        start, _, _ = sl.indices(self.n)
        values = np.asarray(values, F32).reshape(-1)
        r = ROW_NAMES.index(name)
        for b, rec in records(self.slices, sl, self.n):
            self.file.write(values[rec.start - start:rec.stop - start], *self._where(self.gen[b], r, b))
        with self._cond:
            self._fill()

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self._io.shutdown(wait=True)
            self.file.close()
