"""An offload file that cannot lie: a preallocated scratch file whose every read is checked.

:class:`OffloadFile` holds an owner header (owner.py) and then the data, written and read in
records (a bucket's slice of one row): positioned, all-or-nothing reads and writes, in chunks
of :data:`CHUNK` bytes, each chunk hashed (checksum.py) while it is still in cache. The hash
of every record written is kept in memory; a read checks the file's size (fstat) and that the
bytes read hash to what was written (a record never written must read back as the zeros
``posix_fallocate`` made). Anything else -- a file truncated and extended again, reading back
as zeros; another process's bytes; a short read -- is an OffloadError naming the file, the
record and the step. ``check_seconds`` adds up the time spent hashing (the benchmark's cost).
"""
import os
import threading
import time
from typing import Dict, Tuple

import numpy as np

from ...errors import ConfigError, JobError
from .checksum import checksum_function
from .owner import HEADER_BYTES, header_bytes, this_owner

CHUNK = 1 << 19        # bytes read or written, then hashed, at a time: a chunk stays in the L2 cache


class OffloadError(JobError):
    """A read or write of an offload file failed, or read back other bytes than were written."""


class OffloadFile:
    """A scratch file under ``directory`` named ``name``: the owner header, then ``nbytes`` of data."""

    def __init__(self, directory: str, name: str, nbytes: int, rank: int):
        self.path = os.path.join(directory, name)
        self.nbytes = nbytes
        self.size = HEADER_BYTES + nbytes          # what the file must be while this run owns it
        self.step = None                           # the step an error names (set by the engine's parts)
        self.check_seconds = 0.0                   # time spent hashing records (reads and writes)
        self._sums: Dict[int, Tuple[int, int]] = {}   # record offset -> (bytes, hash of what was written)
        self._zero_sums: Dict[int, int] = {}          # bytes -> hash of that many zero bytes
        self._hash = checksum_function()
        self._lock = threading.Lock()              # check_seconds from the I/O thread and the caller's
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.pwrite(self.fd, header_bytes(this_owner(rank), nbytes), 0)
            os.posix_fallocate(self.fd, 0, self.size)
        except OSError as e:
            self.close()
            raise ConfigError(f"cannot make the offload file {self.path} of {self.size:,} bytes: {e.strerror}") from None

    def _fail(self, what: str, record: str, offset: int, nbytes: int, why: str) -> OffloadError:
        return OffloadError(f"offload file {self.path}: {what} of {record} ({nbytes:,} bytes at {offset:,}) failed at "
                            f"step {self.step}: {why}; every rank stops (the last checkpoint stays loadable)")

    def _chunks(self, view: memoryview, address: int, offset: int, io, what: str, record: str) -> int:
        """Move ``view`` to or from the file at data ``offset`` chunk by chunk (``io``: os.preadv or
        os.pwritev); returns the chained hash of its bytes."""
        h, done, spent = 0, 0, 0.0
        while done < len(view):
            end = min(done + CHUNK, len(view))
            if io is os.pwritev:
                t = time.perf_counter()
                h = self._hash(address + done, end - done, h)
                spent += time.perf_counter() - t
            at = done
            while at < end:
                try:
                    got = io(self.fd, [view[at:end]], HEADER_BYTES + offset + at)
                except OSError as e:
                    raise self._fail(what, record, offset, len(view), e.strerror) from None
                if got == 0:
                    raise self._fail(what, record, offset, len(view), f"the file ends after {HEADER_BYTES + offset + at:,} "
                                     f"bytes; this run made it {self.size:,} (was it truncated?)")
                at += got
            if io is os.preadv:
                t = time.perf_counter()
                h = self._hash(address + done, end - done, h)
                spent += time.perf_counter() - t
            done = end
        with self._lock:
            self.check_seconds += spent
        return h

    def write(self, src: np.ndarray, offset: int, record: str) -> None:
        """Write the contiguous array ``src`` as the record at data byte ``offset`` (``record`` names it)."""
        src = np.ascontiguousarray(src)
        view = memoryview(src.reshape(-1).view(np.uint8))
        self._sums[offset] = (len(view), self._chunks(view, src.ctypes.data, offset, os.pwritev, "write", record))

    def read(self, out: np.ndarray, offset: int, record: str) -> None:
        """Read the record at data byte ``offset`` into the contiguous array ``out``, checked."""
        view = memoryview(out.reshape(-1).view(np.uint8))
        size = os.fstat(self.fd).st_size
        if size < HEADER_BYTES + offset + len(view):
            raise self._fail("read", record, offset, len(view), f"the file is {size:,} bytes; this run made it "
                                                                 f"{self.size:,} (was it truncated?)")
        got = self._chunks(view, out.ctypes.data, offset, os.preadv, "read", record)
        written = self._sums.get(offset)
        if written is None:
            want = self._zeros_hash(len(view))
        elif written[0] != len(view):
            raise self._fail("read", record, offset, len(view), f"the record written there was {written[0]:,} bytes")
        else:
            want = written[1]
        if got != want:
            raise self._fail("read", record, offset, len(view), "it returned other bytes than were written (their "
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
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            try:
                os.unlink(self.path)
            except OSError:
                pass
