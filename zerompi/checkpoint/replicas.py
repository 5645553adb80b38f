"""Every step's state in memory twice: this rank's shards in its node's shared memory, and a copy on a buddy's node.

After each step (:meth:`Replicas.commit_step`, a collective between steps) each rank copies its shard of every
part it holds -- one per engine: the plain run's one, a tensor-parallel rank's ``tp{r}-of-{K}``, a pipeline
chunk's ``pp{c}-of-{C}`` (and ``pp{c}-of-{C}/tp{r}-of-{K}``), the folders a disk checkpoint of the run has --
the fp32 master and the optimizer's rows of its slices (AdamW: exp_avg, exp_avg_sq), a checkpoint's shard
file, at any stage, into its shard file in shared memory (mapped: the copy is the write), sends them to its
buddy (the rank at the same place on the next node) with each part's manifest but its shards, and receives its
source's into other mapped shard files of its folder (replica_files.py). Each shard's checksum (zck64, the C
hash of kernels/checksum_cpu.c) is taken as it is copied, one pass over the bytes (CRC-32 of the written file
where that kernel does not build). One all-gather over the ring (the world) agrees that every rank's copies are
complete and carries the checksums; then every rank writes the manifests of the parts in its folder, its own
shards' and its source's, each entry its owner's checksum, which commits the step there. A received copy is not
hashed again each step: a restore verifies every shard it reads against its entry, and where two copies of a
shard are left it takes one that verifies (replica_files.assemble). The manifests are the checkpoint's (loss
scale, update count, the data position in ``extra``), so a restore is the checkpoint's own load, at any
data-parallel size.

:meth:`Replicas.commit_step` does it all between two steps (``--replicas-commit sync``: the committed step is
the last one taken). :meth:`Replicas.commit_behind` (``behind``) copies the step into its mapped files at once
(before the next step changes the state: a memory copy, hashed as it goes) and posts the buddy exchange
(nonblocking, on a duplicate of the ring's communicator), which runs behind the next step's compute, after
which the exchange is waited for and the agreement and the manifests commit it (the committed step then lags
the last one taken by one). The same two steps' files: no memory besides.
"""
import mmap
import os
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..comm.watchdog import watched
from .checksums import zck64_stream
from .format import F32, ZCK64, CheckpointError, Crc32, build_manifest, shard_file
from .state_rows import engine_rows
from .replica_files import commit, prepare, step_dir
from .writer import snapshot

TAG = 4343          # the point-to-point tag of the buddy copy (plus the part's index)
DELAY_ENV = "ZEROMPI_REPLICAS_SEND_DELAY_S"   # test hook: each step's buddy exchange starts this late


class Replicas:
    """This rank's replicas of job ``job`` (replica_files.JOB_NAME): ``parts`` [(part folder, '' for none,
    ZeroEngine)], over ``comm`` (a zerompi Communicator: the ring of ranks, ``rank`` this one's) whose rank r
    lives on node ``nodes[r]`` (nodes of equal size); ``folder`` this rank's folder (replica_files.rank_dir)."""

    def __init__(self, parts: List[Tuple[str, object]], job: str, comm, rank: int, nodes: List[int], folder: str,
                 behind: bool = False):
        n, count = len(nodes), len(set(nodes))
        if count < 2:
            raise CheckpointError(f"replicas={job!r} keeps each shard's second copy on another node, and the {n} "
                                  f"rank{'s' if n > 1 else ''} make one node of {n}: run on 2 nodes or more "
                                  "(--node-size K makes nodes of K ranks on one host)")
        members = [[r for r in range(n) if nodes[r] == k] for k in sorted(set(nodes))]
        if len({len(m) for m in members}) != 1:
            raise CheckpointError(f"replicas={job!r} needs nodes of equal size; the ranks' nodes are {nodes}")
        at = {r: (k, m.index(r)) for k, m in enumerate(members) for r in m}
        self.buddy_of = [members[(at[r][0] + 1) % count][at[r][1]] for r in range(n)]   # same place, next node
        self.parts, self.job, self.comm, self.rank, self.folder = parts, job, comm, rank, folder
        self.buddy, self.source = self.buddy_of[rank], self.buddy_of.index(rank)
        mine = [(part, e.slot, (len(engine_rows(e)), e.layout.shard_numel)) for part, e in parts]
        with watched(comm, "replicas: the ranks' parts and slots"):
            self.table = comm.mpi.allgather(mine)    # every rank's [(part, slot, shape)]
        # Shard groups of whole nodes (--shard-size): the buddy holds these very shards, its own copy is the second.
        self.mirrored = all(self.table[self.buddy_of[r]] == self.table[r] for r in range(n))
        self.theirs = [] if self.mirrored else self.table[self.source]
        self.step: Optional[int] = None          # the last step committed
        self._maps: Dict[int, tuple] = {}        # inode: (file, mapping, array) of the two steps' shard files
        self.behind = behind                     # each step's commit finished after the next step (commit_behind)
        self._pending: Optional[dict] = None     # behind: the step whose commit is under way
        # behind: the buddy exchange on a communicator of its own (no other message of the step can match it)
        self._link = comm.mpi.Dup() if behind and not self.mirrored else None

    @property
    def shape(self) -> Tuple[int, int]:
        """The first part's shard arrays (rows, shard_numel)."""
        return self.table[self.rank][0][2]

    def theory_bytes(self) -> int:
        """Bytes of one step's shard files in this rank's folder: its own and its source's copies."""
        return sum(4 * r * s + 128 for _, _, (r, s) in self.table[self.rank] + self.theirs)

    def commit_step(self, step: int, extra: dict) -> None:
        """Copy, send, checksum and agree on ``step`` (the engines' ``steps_taken``); CheckpointError on every rank
        when a rank could not write its copies (the previous committed step stays)."""
        self._finish(self._start(step, extra))

    def commit_behind(self, step: int, extra: dict) -> None:
        """``--replicas-commit behind``: finish the commit of the step before (its copies' sends waited for, the
        agreement, the manifests), then start ``step``'s: the copy into its shared-memory files and the buddy
        exchange posted (nonblocking), finished at the next call (or :meth:`finish`), behind the next step's
        compute. The committed step is then the one before ``step``'s."""
        self.finish()
        self._pending = self._start(step, extra)

    def finish(self) -> None:
        """The commit started by :meth:`commit_behind`, if one is pending, finished (a collective)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._finish(pending)

    def _start(self, step: int, extra: dict) -> dict:
        """The copy of ``step`` into this rank's files (each hashed as it is written) and its buddy exchange: done
        (sync) or posted (behind)."""
        here, err = step_dir(self.folder, step), None
        mine: List[np.ndarray] = []
        entries: Dict[str, dict] = {}
        try:
            prepare(self.folder, step)
            for (part, slot, shape), (_, e) in zip(self.table[self.rank], self.parts):
                mine.append(self._copy(e, here, part, slot, shape, entries))
        except OSError as exc:
            err = f"rank {self.rank} could not write its replica of step {step} in {here}: {exc.strerror or exc}"
            mine = [snapshot(e, np.empty(shape, F32)) for (_, _, shape), (_, e) in   # still sent: the buddy waits
                    zip(self.table[self.rank], self.parts)]
        heads = {part: build_manifest(e, None, e.tp.extra(extra) if getattr(e, "tp", None) else extra)   # TP: the split
                 for part, e in self.parts}
        state = {"step": step, "err": err, "mine": mine, "heads": heads, "theirs": [], "reqs": [],
                 "entries": None if err else entries}
        if not self.mirrored:
            state["theirs"] = [self._file(here, part, slot, shape) if err is None else np.empty(shape, F32)
                               for part, slot, shape in self.theirs]
            if self._link is None:
                self._exchange(mine, state["theirs"], step)
            else:                            # behind: posted now, waited for after the next step
                state["reqs"] = [self._link.Irecv(buf, source=self.source, tag=TAG + 1 + k)
                                 for k, buf in enumerate(state["theirs"])]
                state["reqs"] += [self._link.Isend(buf, dest=self.buddy, tag=TAG + 1 + k) for k, buf in enumerate(mine)]
        return state

    def _copy(self, engine, here: str, part: str, slot: int, shape, entries: Dict[str, dict]) -> np.ndarray:
        """``engine``'s shard copied into ``slot``'s shard file in ``here``/``part`` (mapped: the host copy is the
        file itself) and its manifest entry put in ``entries``: the file's zck64 taken in the copy's own pass (its
        header first), or CRC-32 of the file written where that kernel does not build."""
        arr = self._file(here, part, slot, shape)
        stream = zck64_stream()
        if stream is None:
            snapshot(engine, arr)
            entries[part] = self._entry(here, part, slot)
            return arr
        _, view, _ = self._mapped(os.path.join(here, part, shard_file(slot)))
        header = np.frombuffer(view, np.uint8, count=len(view) - arr.nbytes)
        stream.update(header)
        del header                               # no export of the mapping left: it may be closed later
        snapshot(engine, arr, stream)
        entries[part] = {"file": shard_file(slot), "bytes": len(view), ZCK64: stream.hexdigest()}
        return arr

    def _finish(self, state: dict) -> None:
        """The buddy exchange waited for, the manifests swapped, the agreement, the step's manifests written."""
        step, err, heads = state["step"], state["err"], state["heads"]
        their_heads = {}
        if not self.mirrored:
            if state["reqs"]:
                from mpi4py import MPI
                with watched(self.comm, "replicas: the shards to the buddy on another node", step):
                    MPI.Request.Waitall(state["reqs"])
            with watched(self.comm, "replicas: the manifests to the buddy", step):
                their_heads = self.comm.mpi.sendrecv(heads, dest=self.buddy, source=self.source, sendtag=TAG,
                                                     recvtag=TAG)
        with watched(self.comm, "replicas: agreement on every rank's copies", step):
            states = self.comm.mpi.allgather((err, state["entries"]))
        failed = next((s[0] for s in states if s[0]), None)
        if failed:
            raise CheckpointError(f"{failed}; the replicas stay at step {self.step}")
        entries: Dict[str, Dict[int, dict]] = {}
        for r, (_, found) in enumerate(states):
            for part, slot, _ in self.table[r]:
                entries.setdefault(part, {}).setdefault(slot, found[part])
        manifests = {}
        for part, head in list(heads.items()) + list(their_heads.items()):
            manifests[part] = dict(head, shards=[entries[part][s] for s in range(head["world_size"])])
        commit(self.folder, step, manifests)
        self.step = step

    def _exchange(self, mine: List[np.ndarray], theirs: List[np.ndarray], step: int) -> None:
        """Each part's shard to the buddy, the source's into ``theirs`` (one message per part)."""
        mpi = self.comm.mpi
        if os.environ.get(DELAY_ENV):
            time.sleep(float(os.environ[DELAY_ENV]))
        with watched(self.comm, "replicas: the shards to the buddy on another node", step):
            if len(mine) == 1 and len(theirs) == 1:
                mpi.Sendrecv(mine[0], dest=self.buddy, sendtag=TAG, recvbuf=theirs[0], source=self.source,
                             recvtag=TAG)
                return
            from mpi4py import MPI
            reqs = [mpi.Irecv(buf, source=self.source, tag=TAG + 1 + k) for k, buf in enumerate(theirs)]
            reqs += [mpi.Isend(buf, dest=self.buddy, tag=TAG + 1 + k) for k, buf in enumerate(mine)]
            MPI.Request.Waitall(reqs)

    def _file(self, here: str, part: str, slot: int, shape) -> np.ndarray:
        """A shard file of ``slot`` in ``here``/``part``, mapped for writing (shared memory: no write of its own).
        The mappings of a rank's two steps' files are kept (the step folders are renamed, the files stay): a
        fresh mapping pays a page fault per page at its first copy, about as much as the copy."""
        folder = os.path.join(here, part)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, shard_file(slot))
        held = self._mapped(path)
        if held is not None and held[2].shape == tuple(shape):
            return held[2]
        fits = False
        if os.path.isfile(path):       # the spare step's: overwritten in place
            arr = np.load(path, mmap_mode="r")
            fits = arr.shape == tuple(shape) and arr.dtype == F32
            del arr
        if not fits:                   # a new file: its header written, its pages zero
            np.lib.format.open_memmap(path, mode="w+", dtype=F32, shape=tuple(shape)).flush()
        f = open(path, "r+b")
        view = mmap.mmap(f.fileno(), 0)
        arr = np.ndarray(tuple(shape), F32, buffer=view, offset=len(view) - 4 * int(np.prod(shape)))
        old = self._maps.pop(os.fstat(f.fileno()).st_ino, None)
        if old is not None:            # a gone file's inode reused
            old[0].close()
        self._maps[os.fstat(f.fileno()).st_ino] = (f, view, arr)
        while len(self._maps) > 2 * (len(self.table[self.rank]) + len(self.theirs)):   # two steps' files
            self._maps.pop(next(iter(self._maps)))[0].close()
        return arr

    def _mapped(self, path: str) -> Optional[tuple]:
        """(file, mapping, array) of ``path`` if this rank holds it mapped (None: not, or the file is gone)."""
        try:
            held = getattr(self, "_maps", {}).get(os.stat(path).st_ino)
            return held if held is not None and os.fstat(held[0].fileno()).st_nlink > 0 else None
        except (OSError, ValueError):    # gone, or its file closed (evicted) meanwhile
            return None

    def _entry(self, here: str, part: str, slot: int) -> dict:
        """The manifest entry of ``slot``'s shard file in ``here``/``part``, read back from the file: bytes and
        the checksum of the whole file (CRC-32: where the C kernel does not build)."""
        path = os.path.join(here, part, shard_file(slot))
        crc = Crc32()
        held = self._mapped(path)
        if held is not None:
            crc.update(held[1])                  # the pages themselves, no copy, no new mapping
        else:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
                crc.update(view)
        return {"file": shard_file(slot), "bytes": os.path.getsize(path), "crc32": crc.hexdigest()}

    def close(self) -> None:
        """At the end (every rank): a pending commit finished, the kept mappings closed."""
        self.finish()
        if self._link is not None:
            self._link.Free()
            self._link = None
        for f, _, _ in self._maps.values():
            f.close()
        self._maps = {}
