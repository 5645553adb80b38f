"""Writing a rank's shard file: now, from the live optimizer arrays, or in the background, from a host copy.

One concern: what a rank writes and on which thread. :class:`PendingSave` is one checkpoint
under way: its temporary directory, the manifest rank 0 built when the save started, and
this rank's write, either done at once (``write_now``: a blocking save streams the arrays
piece by piece, no copy) or on a background thread (``start``: the shard is first copied
into a host buffer, :func:`snapshot`, before the next optimizer update may change it).

The background threads do file I/O only (write, CRC-32, fsync; rank 0's publication), never
an MPI call: mpi4py's thread level need not allow one. Whether every rank's file is complete,
and the publication's outcome, are agreed on the main thread (collective.py: at every
``step()`` while a save is under way, the next save or ``close()``). Nothing here touches MPI.
"""
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, List, Optional, Tuple

import numpy as np

from .format import (F32, ROWS, WRITE_CHUNK_BYTES, CheckpointError, Crc32, crash_point, engine_rows, remove_dir,
                     shard_file)
from .format import publish as publish_files
from .orphans import claim, claimed_copies, recover
from .pointer import DRAFT, ENTRY, write_durable
from .savedir import retain

HOST_BUFFER = "_checkpoint_host"     # the engine attribute holding the reusable host copy
DELAY_ENV = "ZEROMPI_CHECKPOINT_DELAY_S"             # test hook: the background write starts this late
COPY_DELAY_ENV = "ZEROMPI_CHECKPOINT_COPY_DELAY_S"   # test hook: the background host copy starts this late
SALVAGE_WAIT_S = 2.0                 # an abort waits this long at most for the shards of a save under way


class PendingSave:
    """A checkpoint of ``step`` under way in ``tmp`` (a hidden folder of ``directory``).

    ``manifest``: rank 0's, built when the save started (the shard entries are added at
    publication). After publication ``path`` is the checkpoint's directory; after a failure
    ``error`` is the line every rank raised.
    """

    def __init__(self, engine, directory: str, tmp: str, step: int, manifest: Optional[dict],
                 keep_last: Optional[int], finish: Callable, keep=()):
        self.engine, self.directory, self.tmp, self.step = engine, directory, tmp, step
        self.manifest, self.keep_last = manifest, keep_last
        self.draft = None if manifest is None else json.dumps(manifest)   # rank 0's, as the save started
        self.keep = keep                        # checkpoints never removed here (collective.kept)
        self._finish = finish                   # collective.finish: the agreement that publishes
        self.writer = engine.rank < engine.layout.world_size   # the first shard group writes the files
        self.entry: Optional[dict] = None       # this rank's shard entry once written
        self.failure: Optional[str] = None      # this rank's write error
        self.published: Optional[str] = None    # rank 0: the path its background publication gave
        self.path: Optional[str] = None         # the published checkpoint (every rank, once agreed)
        self.error: Optional[str] = None        # the failure every rank raised
        self.removed: list = []                 # checkpoints removed by retention after publication (rank 0)
        self._thread: Optional[threading.Thread] = None
        self._copied = threading.Event()        # set once the shard is in host memory (or not needed)

    # ---- this rank's shard -----------------------------------------------------------
    def write_now(self) -> None:
        """Write the shard on this thread from the live arrays, one piece at a time."""
        if self.writer:
            self._write(own_rows(self.engine))

    def start(self) -> None:
        """Write the shard on a background thread from a host copy. On a GPU the copy is made here
        (pinned memory, fast); on the host the thread makes it, while the next step's forward and
        backward run (they do not change the optimizer state), and :meth:`wait_copied`, called by
        the next step() before its update, waits for it."""
        if not self.writer:
            self._copied.set()
            return
        host = host_buffer(self.engine)
        if self.engine.xp is not np:
            snapshot(self.engine, host)
            self._copied.set()
        self._thread = threading.Thread(target=self._copy_and_write, args=(host,),
                                        name=f"zerompi-checkpoint-{self.step}", daemon=True)
        self._thread.start()

    def wait_copied(self) -> None:
        """Return once the host copy is complete: the optimizer state may change from then on."""
        self._copied.wait()

    def _copy_and_write(self, host) -> None:
        try:
            if not self._copied.is_set():
                _delay(COPY_DELAY_ENV)
                snapshot(self.engine, host)
        except Exception as exc:
            self.failure = f"rank {self.engine.rank} could not copy its shard to host memory: {exc}"
            return
        finally:
            self._copied.set()
        _delay(DELAY_ENV)
        self._write(iter(host))

    def _write(self, rows) -> None:
        e = self.engine
        try:
            if self.draft is not None:         # rank 0, on the writer's thread: what orphans.py publishes from
                write_durable(os.path.join(self.tmp, DRAFT), self.draft)
            self.entry = write_shard(self.tmp, e.slot, e.layout.shard_numel, rows, crash=(self.step, e.rank),
                                     nrows=len(engine_rows(e)))
        except Exception as exc:    # handed to the agreement: every rank raises it, none hangs
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"{type(exc).__name__}: {exc}"
            self.failure = f"rank {e.rank} could not write {os.path.join(self.tmp, shard_file(e.slot))}: {why}"
            return
        if self._thread is not None:
            crash_point("after_shards", self.step)

    # ---- the publication (rank 0) ----------------------------------------------------
    def publish(self, states: list) -> str:
        """Rank 0, once every shard is complete (``states``: every rank's ("done", slot, entry)):
        the folder claimed (orphans.claim), the manifest, the rename into place and ``latest``
        (format.publish), then retention.
        Returns the checkpoint's path; on failure the temporary directory is removed."""
        shards = [e for _, e in sorted((s[1], s[2]) for s in states if s[1] is not None)]
        claimed = claim(self.tmp)     # first: a salvaging rank of this job then leaves the folder alone
        if claimed is None:
            raise CheckpointError(f"{self.tmp} was gone when rank 0 came to publish it (another rank's salvage "
                                  "publishes it)")
        try:
            path = publish_files(self.directory, claimed, self.step, {**self.manifest, "shards": shards}, self.keep)
        except BaseException:
            if os.path.isdir(claimed):
                remove_dir(claimed)
            raise
        self.removed = retain(self.directory, self.keep_last, os.path.basename(path), self.keep)
        return path

    def start_publish(self, states: list) -> None:
        """Rank 0: :meth:`publish` on a background thread (no MPI); ``state()`` then says how it went."""
        def run():
            try:
                self.published = self.publish(states)
            except Exception as exc:
                self.failure = f"cannot finish the checkpoint {self.tmp}: {exc}"
        self._thread = threading.Thread(target=run, name=f"zerompi-publish-{self.step}", daemon=True)
        self._thread.start()

    def busy(self) -> bool:
        """True while a background write or publication runs."""
        return self._thread is not None and self._thread.is_alive()

    def join(self) -> None:
        """Wait for this rank's background copy, write or publication (no MPI: a local wait)."""
        if self._thread is not None:
            self._thread.join()

    def state(self) -> Tuple:
        """What this rank tells the others: ("busy",), ("failed", line), ("published", path) (rank 0,
        after a background publication) or ("done", slot, entry) (slot None: no shard file)."""
        if self.busy():
            return ("busy",)
        if self.failure:
            return ("failed", self.failure)
        if self.published:
            return ("published", self.published)
        return ("done", self.engine.slot if self.writer else None, self.entry)

    def salvage(self) -> None:
        """At an abort (errors.at_abort) before this save was published: publish it once every shard is
        complete (:meth:`recovered`); says so on stdout. What is not complete by then stays in its
        temporary folder, and the next train run into that folder publishes it if it is complete after all."""
        for line in self.recovered():
            sys.stdout.write(f"zerompi: rank {self.engine.rank}: {line}\n")
        sys.stdout.flush()

    def recovered(self) -> List[str]:
        """Publish this save once every rank's shard file is complete (orphans.recover), waiting at most
        SALVAGE_WAIT_S for the other ranks' writes still under way (they may finish after this rank's);
        returns what was published here, one line each ([] where another rank published it or the wait
        ran out). A folder another rank has claimed (rank 0 publishing it, or another rank's salvage) is
        left to that rank, and waited for within the same time: this rank's abort, which follows, must not
        end that rank's publication midway (the next run publishes one that was)."""
        deadline = time.monotonic() + SALVAGE_WAIT_S
        while True:
            lines = recover(self.directory, claimed=False)
            settled = not os.path.isdir(self.tmp) and not claimed_copies(self.tmp)
            if lines or settled or time.monotonic() > deadline:
                return lines
            time.sleep(0.02)

    def wait(self) -> Optional[str]:
        """Finish this save (a collective: every rank calls it) and return the published path.

        Raises CheckpointError on every rank when a rank's write failed (or when it had failed
        earlier: the error is raised once more).
        """
        if self.path is None and self.error is None:
            self._finish(self.engine)
        if self.error:
            raise CheckpointError(self.error)
        return self.path


# ---- the shard file ------------------------------------------------------------------
class _ShardWriter:
    """Writes a file in chunks that end at multiples of WRITE_CHUNK_BYTES (file offsets); each chunk
    is checksummed on a helper thread while it is written (both release the GIL), and once a whole
    aligned span is written its writeback to the disk is started (Linux: posix_fadvise DONTNEED,
    which also drops those pages from the cache once written), so checksumming, copying and the
    disk overlap instead of all waiting for the final fsync. Only whole aligned spans are handed
    over: a page that the next write still fills is never written back, or dropped, early."""

    def __init__(self, f, hasher: ThreadPoolExecutor):
        self.f, self.hasher, self.sum, self.offset, self.flushed = f, hasher, Crc32(), 0, 0

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        at = 0
        while at < len(view):
            n = min(len(view) - at, WRITE_CHUNK_BYTES - self.offset % WRITE_CHUNK_BYTES)
            chunk = view[at:at + n]
            hashed = self.hasher.submit(self.sum.update, chunk)
            try:
                done = 0
                while done < n:                   # a raw file may write less than asked
                    done += self.f.write(chunk[done:])
            finally:
                hashed.result()
            at, self.offset = at + n, self.offset + n
            if self.offset % WRITE_CHUNK_BYTES == 0 and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self.f.fileno(), self.flushed, self.offset - self.flushed, os.POSIX_FADV_DONTNEED)
                self.flushed = self.offset


def write_shard(tmp: str, rank: int, shard_numel: int, chunks: Iterable[np.ndarray],
                crash: Optional[Tuple[int, int]] = None, nrows: int = len(ROWS)) -> dict:
    """Write and fsync ``rank``'s shard file in ``tmp``; returns its manifest entry (file, bytes, crc32),
    also written beside it (``shard_NNNNN.npy.entry``) once the file is on disk.

    ``chunks``: host arrays, row by row (the optimizer's rows, ``nrows`` of them) and in shard order
    within a row, that add up to ``nrows * shard_numel`` elements; consumed one at a time, so a caller's
    generator keeps at most one piece on the host. ``crash``: (step, rank) of the test hook
    ``mid_shard``, which fires after the first piece is written.
    """
    name = shard_file(rank)
    path = os.path.join(tmp, name)
    header = {"descr": "<f4", "fortran_order": False, "shape": (nrows, shard_numel)}
    with open(path, "wb", buffering=0) as f, ThreadPoolExecutor(1, "zerompi-crc32") as hasher:
        out = _ShardWriter(f, hasher)
        np.lib.format.write_array_header_1_0(out, header)
        for k, chunk in enumerate(chunks):
            out.write(np.ascontiguousarray(chunk, dtype="<f4"))
            if k == 0 and crash:
                crash_point("mid_shard", *crash)
        os.fsync(f.fileno())
    entry = {"file": name, "bytes": os.path.getsize(path), "crc32": out.sum.hexdigest()}
    write_durable(path + ENTRY, json.dumps(entry))   # complete: what orphans.py publishes it from, if no one else does
    return entry


# ---- the shard's contents ------------------------------------------------------------
def own_pieces(engine, arr) -> list:
    """This rank's slices of an optimizer array, in shard order (stage 0 holds the whole buffer)."""
    if engine.config.stage > 0:
        return [arr]
    return [arr[b.world_slice(engine.slot)] for b in engine.layout.buckets]


def own_rows(engine) -> Iterator[np.ndarray]:
    """This rank's shard-file contents, one host piece at a time: the rows in order, each in shard order."""
    for row in engine_rows(engine):
        for piece in own_pieces(engine, engine.optimizer.read_row(row)):   # wherever it lives: a host array
            yield np.asarray(piece)


def host_buffer(engine) -> np.ndarray:
    """The host buffer of asynchronous saves (rows x shard_numel, float32): allocated at the first
    and reused by the next ones (pinned memory on a GPU, so the device copies at full speed);
    ``free_snapshot`` drops it."""
    shape = (len(engine_rows(engine)), engine.layout.shard_numel)
    host = getattr(engine, HOST_BUFFER, None)
    if host is None or host.shape != shape:
        host = _empty_host(shape, engine.xp)
        setattr(engine, HOST_BUFFER, host)
    return host


def snapshot(engine, host: Optional[np.ndarray] = None, stream=None) -> np.ndarray:
    """Copy this rank's shard into ``host`` (default: :func:`host_buffer`) and return it. ``stream`` (a
    checksums.Zck64Stream, or None): fed every byte of ``host`` in order as it is written (a host piece's copy
    and its hash in one pass), the rows' pieces and what they leave of a row (C-contiguous ``host``)."""
    host = host_buffer(engine) if host is None else host
    for k, row in enumerate(engine_rows(engine)):
        at = 0
        for piece in own_pieces(engine, _live_row(engine, row)):
            dst = host[k, at:at + piece.size]
            if hasattr(piece, "get"):
                piece.get(out=dst)
                if stream is not None:
                    stream.update(dst)
            elif stream is not None:
                stream.copy(dst, piece)
            else:
                np.copyto(dst, piece)
            at += piece.size
        if stream is not None and at < host.shape[1]:
            stream.update(host[k, at:])
    return host


def _live_row(engine, name: str):
    """An optimizer row as it lives: on a device the array itself (copied into pinned memory by the
    caller), else a host array (the row itself, or from a file a copy: engine/offload/)."""
    rows = engine.optimizer.rows
    return rows.read(name) if getattr(rows, "place", None) == "device" else engine.optimizer.read_row(name)


def free_snapshot(engine) -> None:
    if getattr(engine, HOST_BUFFER, None) is not None:
        setattr(engine, HOST_BUFFER, None)


def _delay(name: str) -> None:
    """Test hooks: ``ZEROMPI_CHECKPOINT_COPY_DELAY_S`` / ``ZEROMPI_CHECKPOINT_DELAY_S`` make the background
    thread wait that many seconds before the host copy / before the write (a slow machine, a slow disk)."""
    if os.environ.get(name):
        time.sleep(float(os.environ[name]))


def _empty_host(shape, xp) -> np.ndarray:
    if xp is not np:
        try:
            import cupyx
            return cupyx.empty_pinned(shape, F32)
        except (ImportError, AttributeError):
            pass
    return np.empty(shape, F32)
