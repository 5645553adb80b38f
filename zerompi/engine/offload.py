"""Where the optimizer state lives (ZeRO-Offload, ZeRO-Infinity): the rows of the fp32 master and
the Adam moments, and stage 3's stored parameter shard, behind one small interface.

- :class:`ArrayRows` keeps the three rows as arrays: on the device (no offload), or in host
  memory (``offload_optimizer="cpu"``, pinned when the device is a GPU).
- :class:`FileRows` keeps them in one preallocated file per rank under ``offload_dir``
  (``"nvme"``) and streams them bucket by bucket through three sets of host buffers: a
  background thread reads the next bucket's rows while the current one is updated and
  writes the previous one back (``os.preadv`` / ``os.pwritev``, no copies), so the resident
  optimizer memory is three buckets' rows, not 12 Psi / N.
- :class:`ParamFile` keeps stage 3's stored parameter shard in a file (``offload_params="nvme"``).

A failed or short read or write raises OffloadError (a JobError: the CLI prints one line)
naming the file, what was read or written, and the step. The files are scratch: made when
the engine starts, removed when it closes; checkpoints hold the state (checkpoint/).
"""
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..errors import ConfigError, JobError

F32 = np.float32
ROW_NAMES = ("master", "exp_avg", "exp_avg_sq")


class OffloadError(JobError):
    """A read or write of an offload file failed."""


def check_dir(path: str, need: int) -> None:
    """ConfigError unless ``path`` is a writable folder with ``need`` bytes free (checked at start)."""
    if not path:
        raise ConfigError("offload to nvme needs offload_dir (--offload-dir DIR): a folder for the state files")
    if not os.path.isdir(path):
        raise ConfigError(f"offload_dir={path!r} is not a folder; create it or name another")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"offload_dir={path!r} is not writable; name a folder this job can write")
    free = shutil.disk_usage(path).free
    if free < need:
        raise ConfigError(f"offload_dir={path!r} has {free:,} bytes free; this rank's offload files need {need:,}")


class _File:
    """A preallocated scratch file and positioned, all-or-nothing reads and writes of arrays."""

    def __init__(self, directory: str, name: str, nbytes: int):
        self.path = os.path.join(directory, name)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if nbytes:
                os.posix_fallocate(self.fd, 0, nbytes)
        except OSError as e:
            self.close()
            raise ConfigError(f"cannot make the offload file {self.path} of {nbytes:,} bytes: {e.strerror}") from None
        self.step = None               # the step an error names (set by the engine's parts)

    def _fail(self, what: str, offset: int, nbytes: int, why: str):
        return OffloadError(f"offload file {self.path}: {what} of {nbytes:,} bytes at {offset:,} failed at step "
                            f"{self.step}: {why}; every rank stops (the last checkpoint stays loadable)")

    def read(self, out: np.ndarray, offset: int) -> None:
        view = memoryview(out.reshape(-1).view(np.uint8))
        done = 0
        while done < len(view):
            try:
                got = os.preadv(self.fd, [view[done:]], offset + done)
            except OSError as e:
                raise self._fail("read", offset, len(view), e.strerror) from None
            if got == 0:
                raise self._fail("read", offset, len(view), f"the file ends after {done:,} bytes (was it truncated?)")
            done += got

    def write(self, src: np.ndarray, offset: int) -> None:
        view = memoryview(np.ascontiguousarray(src).reshape(-1).view(np.uint8))
        done = 0
        while done < len(view):
            try:
                done += os.pwritev(self.fd, [view[done:]], offset + done)
            except OSError as e:
                raise self._fail("write", offset, len(view), e.strerror) from None

    def sync(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            try:
                os.unlink(self.path)
            except OSError:
                pass


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

    ``alloc(n)``: a host float32 array (the ledger's, counted under "buffers" on the host);
    ``largest``: the longest slice a step fetches; ``slices``: how many there are (one set of
    buffers per slice when there are fewer than three: streaming needs several buckets)."""

    streamed = True

    def __init__(self, directory: str, name: str, n: int, largest: int, slices: int, alloc):
        self.place = "disk"
        self.n = n
        self.file = _File(directory, name, 3 * 4 * n)
        sets = max(1, min(3, slices))
        self._sets = [[alloc(largest) for _ in ROW_NAMES] for _ in range(sets)]
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerompi-offload")
        self._free = list(range(sets))
        self._pending: Dict[int, object] = {}   # buffer set -> the future that must finish before reuse
        self._reads: Dict[Tuple[int, int], Tuple[int, object]] = {}   # slice -> (set, read future)
        self._order: List[slice] = []
        self._lock = threading.Lock()

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

    def _read_rows(self, sl: slice, bufs) -> None:
        for r, buf in enumerate(bufs):
            self.file.read(buf, 4 * (r * self.n + sl.start))

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
            self.file.write(buf, 4 * (r * self.n + sl.start))

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
        self.file.read(out, 4 * (ROW_NAMES.index(name) * self.n + start))
        return out

    def write(self, name: str, sl: slice, values) -> None:
        start, stop, _ = sl.indices(self.n)
        self.file.write(np.asarray(values, F32).reshape(-1), 4 * (ROW_NAMES.index(name) * self.n + start))

    def close(self) -> None:
        self._io.shutdown(wait=True)
        self.file.close()


class ParamFile:
    """Stage 3's stored parameter shard in a file (``offload_params="nvme"``)."""

    def __init__(self, directory: str, name: str, n: int, dtype):
        self.dtype, self.n = np.dtype(dtype), n
        self.file = _File(directory, name, n * self.dtype.itemsize)

    def at_step(self, step: int) -> None:
        self.file.step = step

    def read(self, sl: slice, out: Optional[np.ndarray] = None) -> np.ndarray:
        start, stop, _ = sl.indices(self.n)
        out = np.empty(stop - start, self.dtype) if out is None else out
        self.file.read(out, start * self.dtype.itemsize)
        return out

    def write(self, sl: slice, values) -> None:
        start, _, _ = sl.indices(self.n)
        self.file.write(np.asarray(values, self.dtype), start * self.dtype.itemsize)

    def close(self) -> None:
        self.file.close()
