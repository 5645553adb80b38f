"""An offload file that cannot lie: a preallocated scratch file whose every read is checked.

:class:`OffloadFile` holds an owner header (owner.py) and then the data, written and read in
records (a bucket's slice of one row): positioned, all-or-nothing reads and writes, through the
page cache in chunks of :data:`CHUNK` bytes, each chunk hashed (checksum.py) while it is still
in cache, or -- opened with O_DIRECT, for aligned records -- one transfer by the device, then
hashed chunk by chunk (the same hash either way). The hash
of every record written is kept in memory; a read checks the file's size (fstat) and that the
bytes read hash to what was written (a record never written must read back as the zeros
``posix_fallocate`` made). Anything else -- a file truncated and extended again, reading back
as zeros; another process's bytes; a short read -- is an OffloadError naming the file, the
record and the step. ``check_seconds`` adds up the time spent hashing (the benchmark's cost).
"""
import os
import threading
import time
from typing import Dict, Optional, Tuple

import numpy as np

from ...errors import ConfigError, JobError
from ...checkpoint.checksums import checksum_function
from .owner import HEADER_BYTES, header_bytes, this_owner

CHUNK = 1 << 19        # bytes read or written, then hashed, at a time: a chunk stays in the L2 cache
ALIGN = 4096           # O_DIRECT: file offsets, lengths and buffer addresses are multiples of this


class OffloadError(JobError):
    """A read or write of an offload file failed, or read back other bytes than were written."""


class OffloadFile:
    """A scratch file under ``directory`` named ``name``: the owner header, then ``nbytes`` of data.

    ``direct``: also open it with O_DIRECT, used for every transfer whose file offset, length and
    buffer address are multiples of :data:`ALIGN` (the device moves the bytes; no copy through the
    page cache); other transfers, and every transfer where the filesystem refuses O_DIRECT
    (tmpfs), go through the page cache."""

    def __init__(self, directory: str, name: str, nbytes: int, rank: int, direct: bool = False):
        self.path = os.path.join(directory, name)
        self.nbytes = nbytes
        self.size = HEADER_BYTES + nbytes          # what the file must be while this run owns it
        self.step = None                           # the step an error names (set by the engine's parts)
        self.check_seconds = 0.0                   # time spent hashing records (reads and writes)
        self._sums: Dict[int, Tuple[int, int]] = {}   # record offset -> (bytes, hash of what was written)
        self._zero_sums: Dict[int, int] = {}          # bytes -> hash of that many zero bytes
        self._hash = checksum_function()
        self._lock = threading.Lock()              # check_seconds from the I/O thread and the caller's
        self._op_step: Dict[int, object] = {}      # thread -> the step its current transfer is for
        self.direct_fd = None
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.pwrite(self.fd, header_bytes(this_owner(rank), nbytes), 0)
            os.posix_fallocate(self.fd, 0, self.size)
        except OSError as e:
            self.close()
            raise ConfigError(f"cannot make the offload file {self.path} of {self.size:,} bytes: "
                              f"{e.strerror}") from None
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.direct_fd = os.open(self.path, os.O_RDWR | os.O_DIRECT)
            except OSError:                        # the filesystem refuses O_DIRECT: the page cache it is
                self.direct_fd = None

    def _fail(self, what: str, record: str, offset: int, nbytes: int, why: str) -> OffloadError:
        step = self._op_step.get(threading.get_ident(), self.step)
        return OffloadError(f"offload file {self.path}: {what} of {record} ({nbytes:,} bytes at {offset:,}) failed at "
                            f"step {step}: {why}; every rank stops (the last checkpoint stays loadable)")

    def _transfer(self, fd: int, view: memoryview, at: int, end: int, offset: int, io, what: str, record: str) -> None:
        while at < end:
            try:
                got = io(fd, [view[at:end]], HEADER_BYTES + offset + at)
            except OSError as e:
                raise self._fail(what, record, offset, len(view), e.strerror) from None
            if got == 0:
                raise self._fail(what, record, offset, len(view), f"the file ends after {HEADER_BYTES + offset + at:,} "
                                 f"bytes; this run made it {self.size:,} (was it truncated?)")
            at += got

    def _move(self, arr: np.ndarray, offset: int, io, what: str, record: str, hashed: int) -> int:
        """Move the contiguous ``arr`` to or from the file at data ``offset`` (``io``: os.preadv or
        os.pwritev); returns the hash of its first ``hashed`` bytes, taken chunk by chunk (CHUNK bytes,
        whatever the transfers: the same record hashes the same read either way)."""
        view = memoryview(arr.reshape(-1).view(np.uint8))
        address, n = arr.ctypes.data, len(view)
        direct = (self.direct_fd is not None and address % ALIGN == 0 and n % ALIGN == 0
                  and (HEADER_BYTES + offset) % ALIGN == 0)
        fd, step = (self.direct_fd, n) if direct else (self.fd, CHUNK)   # O_DIRECT: one transfer, the device's
        h, spent = 0, 0.0
        for done in range(0, n, step):
            end = min(done + step, n)
            if io is os.preadv:
                self._transfer(fd, view, done, end, offset, io, what, record)
            t = time.perf_counter()
            for lo in range(done, min(end, hashed), CHUNK):
                h = self._hash(address + lo, min(lo + CHUNK, hashed) - lo, h)
            spent += time.perf_counter() - t
            if io is os.pwritev:
                self._transfer(fd, view, done, end, offset, io, what, record)
        with self._lock:
            self.check_seconds += spent
        return h

    def for_step(self, step) -> None:
        """The step this thread's next transfers are for (named by their errors; default ``self.step``)."""
        self._op_step[threading.get_ident()] = step

    def digest(self, arr: np.ndarray, nbytes: int) -> int:
        """The hash of the first ``nbytes`` bytes of the contiguous ``arr``, chunk by chunk as a transfer
        hashes them (for a caller that hashes where the bytes are in cache: offload/stream.py)."""
        t, h = time.perf_counter(), 0
        for lo in range(0, nbytes, CHUNK):
            h = self._hash(arr.ctypes.data + lo, min(lo + CHUNK, nbytes) - lo, h)
        with self._lock:
            self.check_seconds += time.perf_counter() - t
        return h

    def write(self, src: np.ndarray, offset: int, record: str, nbytes: Optional[int] = None,
              digest: Optional[int] = None) -> None:
        """Write the contiguous array ``src`` as the record at data byte ``offset`` (``record`` names it);
        ``nbytes``: the record's own bytes when ``src`` is longer (padded to ALIGN: the rest is not kept);
        ``digest``: their hash, when the caller took it (:meth:`digest`)."""
        src = np.ascontiguousarray(src)
        n = src.nbytes if nbytes is None else nbytes
        got = self._move(src, offset, os.pwritev, "write", record, 0 if digest is not None else n)
        self._sums[offset] = (n, got if digest is None else digest)

    def read(self, out: np.ndarray, offset: int, record: str, nbytes: Optional[int] = None,
             check: bool = True) -> None:
        """Read the record at data byte ``offset`` into the contiguous array ``out``, checked (``check``
        False: the caller calls :meth:`verify` later); ``nbytes``: the record's own bytes when ``out`` is
        longer (padded)."""
        n = out.nbytes if nbytes is None else nbytes
        size = os.fstat(self.fd).st_size
        if size < HEADER_BYTES + offset + out.nbytes:
            raise self._fail("read", record, offset, n, f"the file is {size:,} bytes; this run made it "
                                                        f"{self.size:,} (was it truncated?)")
        got = self._move(out, offset, os.preadv, "read", record, n if check else 0)
        if check:
            self._compare(got, offset, record, n)

    def verify(self, out: np.ndarray, offset: int, record: str, nbytes: int) -> None:
        """Check a record read with ``check=False`` into ``out``: OffloadError unless it is what was written."""
        self._compare(self.digest(out, nbytes), offset, record, nbytes)

    def _compare(self, got: int, offset: int, record: str, n: int) -> None:
        written = self._sums.get(offset)
        if written is None:
            want = self._zeros_hash(n)
        elif written[0] != n:
            raise self._fail("read", record, offset, n, f"the record written there was {written[0]:,} bytes")
        else:
            want = written[1]
        if got != want:
            raise self._fail("read", record, offset, n, "it returned other bytes than were written (their "
                             "checksums differ): the file was changed outside this run (truncated and extended "
                             "again, or overwritten)")

    def _zeros_hash(self, nbytes: int) -> int:
        """The hash of ``nbytes`` zero bytes, chunked as a read hashes them (a record never written)."""
        if nbytes not in self._zero_sums:
            zeros = np.zeros(min(nbytes, CHUNK), np.uint8)
            h, done = 0, 0
            while done < nbytes:
                k = min(CHUNK, nbytes - done)
                h = self._hash(zeros.ctypes.data, k, h)
                done += k
            self._zero_sums[nbytes] = h
        return self._zero_sums[nbytes]

    def sync(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        """Close and remove the file (it is scratch: checkpoints hold the state)."""
        if self.direct_fd is not None:
            os.close(self.direct_fd)
            self.direct_fd = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            try:
                os.unlink(self.path)
            except OSError:
                pass
