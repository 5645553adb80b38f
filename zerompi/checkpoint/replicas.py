"""Every step's state in memory twice: this rank's shard in its node's shared memory, and a copy on a buddy's node.

After each step (:meth:`Replicas.commit_step`, a collective between steps) each rank copies its shard -- the fp32
master, exp_avg and exp_avg_sq of its slices, the rows of a checkpoint's shard file, whatever the stage -- to the
host, sends it to its buddy (the rank ``node_size`` places on: the same place on the next node), and writes its
own and the received copy as shard files into its folder (replica_files.py). One all-gather agrees that every
rank's two copies are complete and equal (their CRC-32s); then every rank writes the step's manifest, which
commits it, and drops its previous step. The manifest is the checkpoint's (loss scale, update count, the data
position in ``extra``), so a restore is the checkpoint's own load, at any world size.
"""
import os
from typing import Optional

import numpy as np

from ..comm.watchdog import watched
from ..errors import ConfigError
from .format import F32, ROWS, CheckpointError, build_manifest
from .replica_files import commit, rank_dir, step_dir
from .writer import snapshot, write_shard

TAG = 4343          # the point-to-point tag of the buddy copy


class Replicas:
    """This rank's replicas of job ``job`` (replica_files.JOB_NAME) for ``engine`` (a ZeroEngine)."""

    def __init__(self, engine, job: str):
        topo, n, rank = engine.topology, engine.world_size, engine.rank
        if topo.nodes < 2:
            raise ConfigError(f"replicas={job!r} keeps each shard's second copy on another node, and the {n} "
                              f"rank{'s' if n > 1 else ''} make one node of {topo.node_size}: run on 2 nodes or more "
                              "(--node-size K makes nodes of K ranks on one host)")
        self.engine, self.job = engine, job
        self.buddy, self.source = (rank + topo.node_size) % n, (rank - topo.node_size) % n
        self.folder = rank_dir(job, topo.node_of(rank), rank)
        with watched(engine.comm, "replicas: the ranks' slots"):
            self.slots = engine.comm.mpi.allgather(engine.slot)
        shape = (len(ROWS), engine.layout.shard_numel)
        self.host, self.received = np.empty(shape, F32), np.empty(shape, F32)
        self.nbytes = 2 * self.host.nbytes       # host buffers; the folder: two shard files a step (x2 at a commit)
        self.step: Optional[int] = None          # the last step committed

    def commit_step(self, step: int, extra: dict) -> None:
        """Copy, send, write and agree on ``step`` (``engine.steps_taken``); CheckpointError on every rank when a
        rank could not write its copies (the previous committed step stays)."""
        e = self.engine
        snapshot(e, self.host)
        with watched(e.comm, "replicas: the shard to the buddy on another node", step):
            e.comm.mpi.Sendrecv(self.host, dest=self.buddy, sendtag=TAG, recvbuf=self.received,
                                source=self.source, recvtag=TAG)
        here, err, own, copy = step_dir(self.folder, step), None, None, None
        try:
            os.makedirs(here, exist_ok=True)
            own = write_shard(here, e.slot, e.layout.shard_numel, iter(self.host))
            copy = write_shard(here, self.slots[self.source], e.layout.shard_numel, iter(self.received))
        except OSError as exc:
            err = f"rank {e.rank} could not write its replicas of step {step} in {here}: {exc.strerror or exc}"
        with watched(e.comm, "replicas: agreement on every rank's two copies", step):
            states = e.comm.mpi.allgather((err, own, copy))
        failed = next((s[0] for s in states if s[0]), None)
        entries = {}
        for r, (_, mine, _) in enumerate(states):
            if mine is not None:
                entries.setdefault(self.slots[r], mine)
        for r, (_, _, theirs) in enumerate(states):
            src = (r - e.topology.node_size) % e.world_size
            if not failed and theirs["crc32"] != states[src][1]["crc32"]:
                failed = f"rank {r}'s copy of rank {src}'s shard of step {step} differs from it (CRC-32)"
        if failed:
            raise CheckpointError(f"{failed}; the replicas stay at step {self.step}")
        shards = [entries[s] for s in range(e.layout.world_size)]
        commit(self.folder, step, build_manifest(e, shards, extra))
        self.step = step
