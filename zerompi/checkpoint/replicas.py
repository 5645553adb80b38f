"""Every step's state in memory twice: this rank's shard in its node's shared memory, and a copy on a buddy's node.

After each step (:meth:`Replicas.commit_step`, a collective between steps) each rank copies its shard -- the
fp32 master and the optimizer's rows of its slices (AdamW: exp_avg, exp_avg_sq), a checkpoint's shard file, at
any stage -- into its shard file in shared memory (mapped: the copy is the write), sends it to its buddy (the
rank ``node_size`` places on: the same place on the next node), and receives its source's copy into another
mapped shard file of its folder (replica_files.py). One all-gather agrees that every rank's two copies are
complete; then every rank writes the step's manifest (its own shard's CRC-32 in it), which commits it. The
received copy's CRC-32 is compared with its owner's on a thread, behind the next step, and a difference raised
at the next commit. The manifest is the checkpoint's (loss scale, update count, the data position in
``extra``), so a restore is the checkpoint's own load, at any world size.
"""
import mmap
import os
import threading
from typing import Optional

import numpy as np

from ..comm.watchdog import watched
from .format import F32, CheckpointError, Crc32, build_manifest, shard_file
from .state_rows import engine_rows
from .replica_files import commit, prepare, rank_dir, step_dir
from .writer import snapshot

TAG = 4343          # the point-to-point tag of the buddy copy


class Replicas:
    """This rank's replicas of job ``job`` (replica_files.JOB_NAME) for ``engine`` (a ZeroEngine)."""

    def __init__(self, engine, job: str):
        topo, n, rank = engine.topology, engine.world_size, engine.rank
        if topo.nodes < 2:
            raise CheckpointError(f"replicas={job!r} keeps each shard's second copy on another node, and the {n} "
                              f"rank{'s' if n > 1 else ''} make one node of {topo.node_size}: run on 2 nodes or more "
                              "(--node-size K makes nodes of K ranks on one host)")
        self.engine, self.job = engine, job
        self.buddy, self.source = (rank + topo.node_size) % n, (rank - topo.node_size) % n
        self.folder = rank_dir(job, topo.node_of(rank), rank)
        with watched(engine.comm, "replicas: the ranks' slots"):
            self.slots = engine.comm.mpi.allgather(engine.slot)
        # Shard groups of whole nodes (--shard-size): the buddy holds this very slot, its own copy is the second.
        self.mirrored = all(self.slots[(r + topo.node_size) % n] == self.slots[r] for r in range(n))
        self.shape = (len(engine_rows(engine)), engine.layout.shard_numel)   # the shard files' arrays, no other
        self.step: Optional[int] = None          # the last step committed
        self._check: Optional[threading.Thread] = None   # the CRC-32 of the last step's received copy
        self._found: Optional[str] = None        # what it found wrong

    def commit_step(self, step: int, extra: dict) -> None:
        """Copy, send, checksum and agree on ``step`` (``engine.steps_taken``); CheckpointError on every rank when a
        rank could not write its copies (the previous committed step stays)."""
        e = self.engine
        late = self._late()                  # the last step's copy checked: before its files are reused
        here, err, own = step_dir(self.folder, step), None, None
        try:
            prepare(self.folder, step)
            mine = self._file(here, e.slot)          # the shard's host copy is the file itself: one copy
            snapshot(e, mine)
        except OSError as exc:
            err, mine = f"rank {e.rank} could not write its replica of step {step} in {here}: {exc.strerror or exc}", \
                np.empty(self.shape, F32)
            snapshot(e, mine)                        # still sent: the buddy is waiting for it
        theirs = mine if self.mirrored else self._file(here, self.slots[self.source]) if err is None \
            else np.empty(self.shape, F32)
        if not self.mirrored:
            with watched(e.comm, "replicas: the shard to the buddy on another node", step):
                e.comm.mpi.Sendrecv(mine, dest=self.buddy, sendtag=TAG, recvbuf=theirs, source=self.source,
                                    recvtag=TAG)
        if err is None:
            own = self._entry(here, e.slot)
        with watched(e.comm, "replicas: agreement on every rank's two copies", step):
            states = e.comm.mpi.allgather((err or late, own))
        failed = next((s[0] for s in states if s[0]), None)
        if failed:
            raise CheckpointError(f"{failed}; the replicas stay at step {self.step}")
        entries = {}
        for r, (_, mine_entry) in enumerate(states):
            entries.setdefault(self.slots[r], mine_entry)
        shards = [entries[s] for s in range(e.layout.world_size)]
        commit(self.folder, step, build_manifest(e, shards, extra))
        self.step = step
        if not self.mirrored:                # the copy's checksum, behind the next step (checked at the next commit)
            self._check = threading.Thread(target=self._check_copy, name="zerompi-replica-check", daemon=True,
                                           args=(here, step, states[self.source][1]))
            self._check.start()

    def _late(self) -> Optional[str]:
        """What the check of the last step's received copy found (None: equal, or nothing to check)."""
        if self._check is not None:
            self._check.join()
            self._check = None
        found, self._found = self._found, None
        return found

    def _check_copy(self, here: str, step: int, entry: dict) -> None:
        got = self._entry(here, self.slots[self.source])
        if got["crc32"] != entry["crc32"] or got["bytes"] != entry["bytes"]:
            self._found = (f"rank {self.engine.rank}'s copy of rank {self.source}'s shard of step {step} differs from "
                           "it (CRC-32)")

    def _file(self, here: str, slot: int) -> np.ndarray:
        """A shard file of ``slot`` in ``here``, mapped for writing (shared memory: no write of its own)."""
        path = os.path.join(here, shard_file(slot))
        if os.path.isfile(path):       # the spare step's: overwritten in place
            arr = np.load(path, mmap_mode="r+")
            if arr.shape == self.shape and arr.dtype == F32:
                return arr
        return np.lib.format.open_memmap(path, mode="w+", dtype=F32, shape=self.shape)

    @staticmethod
    def _entry(here: str, slot: int) -> dict:
        """The manifest entry of ``slot``'s shard file in ``here``: bytes and CRC-32 of the whole file."""
        path = os.path.join(here, shard_file(slot))
        crc = Crc32()
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            crc.update(view)           # the pages themselves, no copy
        return {"file": shard_file(slot), "bytes": os.path.getsize(path), "crc32": crc.hexdigest()}
