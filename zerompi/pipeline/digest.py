"""The sha256 of the whole model's parameters, in model order, when its chunks live on several stages.

An unpipelined run hashes its fp32 master parameters in layout order (layer after layer) as one
stream (train/job.py, with bucket_bytes below). Here the chunks are on other ranks, and a hash's state
cannot be sent, so the stream comes to one rank: the rank of stage 0 with data-parallel rank 0 of each TP coordinate
hashes chunk after chunk; each chunk's bytes arrive from its stage's data-parallel rank 0 one bucket at
a time (never the whole model at once), gathered there from the chunk's shards (a collective over the
chunk's data-parallel group). Equal to the unpipelined run's digest when the parameters are equal.
"""
import hashlib
from types import SimpleNamespace
from typing import Optional

import numpy as np

from ..comm.watchdog import watched

TAG = 41


def bucket_bytes(engine):
    """(bucket's parameters as little-endian fp32 bytes in layout order) for each bucket (a collective)."""
    lay = engine.layout
    engine.synchronize()
    for bucket, values in engine.optimizer.gather_buckets(engine.group, engine.steps_taken):
        parts = []
        for layer in bucket.layers:
            for name in lay.layer_params[layer]:
                pr = lay.params[name]
                parts.append(np.ascontiguousarray(values[pr.bucket_offset:pr.bucket_offset + pr.numel], "<f4"))
        yield np.concatenate(parts) if parts else np.empty(0, "<f4")


def model_digest(engines, schedule, mesh, stream=None) -> Optional[str]:
    """On the hashing rank (pp 0, dp 0) of each TP coordinate: the hex digest of its model's parameters (its
    TP pieces) over every chunk in order; elsewhere None. A collective over the whole mesh. ``stream(c)``: chunk
    c's arrays in hashing order (a collective over its stage; default: its engine's buckets, bucket_bytes)."""
    where, me = schedule.placement(), mesh.pp_rank
    mpi = mesh.pp_mpi
    lead = mesh.dp_rank == 0
    waits = SimpleNamespace(mpi=mpi, waiting=next(iter(engines.values())).comm.waiting)
    digest = hashlib.sha256() if (me == 0 and lead) else None
    for c in range(schedule.chunks):
        owner = where[c]
        if owner == me:
            for data in (bucket_bytes(engines[c]) if stream is None else stream(c)):
                if digest is not None:
                    digest.update(data.data)
                elif lead:
                    with watched(waits, f"model hash: chunk {c} to stage 0"):
                        mpi.Send(np.array([data.size], np.int64), dest=0, tag=TAG)
                        mpi.Send(data, dest=0, tag=TAG)
            if lead and digest is None:
                with watched(waits, f"model hash: chunk {c} to stage 0"):
                    mpi.Send(np.array([-1], np.int64), dest=0, tag=TAG)
        elif digest is not None:
            count = np.empty(1, np.int64)
            while True:
                with watched(waits, f"model hash: chunk {c} from stage {owner}"):
                    mpi.Recv(count, source=owner, tag=TAG)
                    if count[0] < 0:
                        break
                    buf = np.empty(int(count[0]), "<f4")
                    mpi.Recv(buf, source=owner, tag=TAG)
                digest.update(buf.data)
    return digest.hexdigest() if digest is not None else None
