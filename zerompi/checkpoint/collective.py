"""Sharded checkpoints, the collective protocol: every rank saves its slices and loads its new ones.

One concern: what each rank writes and reads, and how the ranks agree, in ``save`` and
``load`` (collectives over the engine's communicator, each one timed by the watchdog).
Loading maps every parameter through the saved layout, so the world size, stage and
bucket size may all change; :func:`copy_plan` gives the pieces of the old shards that make
up a rank's new slices, and each rank reads only those.

The files themselves (manifest, shard files, checksums, the atomic move of ``latest``) are
format.py's; the offline tools (``python -m zerompi.checkpoint``) are cli.py's.
"""
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..comm.watchdog import watched
from .format import (F32, ROWS, CheckpointError, SavedLayout, build_manifest, check_model,
                     crash_point, make_temp_dir, publish, read_manifest, resolve, shard_file, verify_shard,
                     write_shard)


@dataclass(frozen=True)
class LoadInfo:
    """What :func:`load` restored."""
    path: str          # the checkpoint directory that was read
    manifest: dict     # its manifest (``manifest["extra"]`` is the caller's extra_state)
    bytes_read: int    # bytes of shard data this rank copied (checksumming not counted)


# ---- save -------------------------------------------------------------------------
def save(engine, directory: str, extra_state: Optional[dict] = None) -> str:
    """Write ``engine``'s state as ``directory``/step_NNNNNN/ and point ``directory``/latest at it.

    A collective: the ranks of the first shard group write one shard file each, named by the
    slice of every bucket they hold (the other groups hold copies), rank 0 the manifest.
    NNNNNN is ``engine.steps_taken``. ``extra_state``: JSON-able dict stored as
    ``manifest["extra"]``. Returns the new checkpoint's directory. Every rank sees
    ``directory`` (a shared file system).
    """
    comm, rank, step = engine.comm, engine.rank, engine.steps_taken
    writer = rank < engine.layout.world_size      # the first shard group: ranks 0 .. shard_size - 1
    mpi = comm.mpi
    engine.guard.at("save", step)        # ZEROMPI_FAULT=KIND@rankR:stepS:save (engine/faults.py)
    tmp = err = None
    if rank == 0:
        try:
            tmp = make_temp_dir(directory, step)
        except OSError as e:
            err = f"cannot create a checkpoint in {directory}: {e}"
    # Each collective is timed by the watchdog: a rank that dies or hangs in a save ends the job.
    with watched(comm, "checkpoint save: broadcast of the temporary directory", step):
        tmp, err = mpi.bcast((tmp, err), root=0)
    if err:
        raise CheckpointError(err)
    entry = err = None
    try:
        if writer:
            entry = write_shard(tmp, engine.slot, engine.layout.shard_numel, _own_rows(engine))
    except OSError as e:
        err = f"rank {rank} could not write its shard in {tmp}: {e}"
    crash_point("after_shards", step)
    with watched(comm, "checkpoint save: gather of shard entries", step):
        entries = mpi.gather((engine.slot if writer else None, entry, err), root=0)
    result = None
    if rank == 0:
        errors = [e for _, _, e in entries if e]
        shards = [e for _, e in sorted((s, e) for s, e, _ in entries if s is not None)]
        try:
            result = (None, errors[0]) if errors else \
                (publish(directory, tmp, step, build_manifest(engine, shards, extra_state)), None)
        except OSError as e:
            result = (None, f"cannot finish the checkpoint {tmp}: {e}")
    with watched(comm, "checkpoint save: broadcast of the result (manifest written, latest moved)", step):
        path, err = mpi.bcast(result, root=0)
    if err:
        raise CheckpointError(err)
    return path


def _own_pieces(engine, arr) -> list:
    """This rank's slices of an optimizer array, in shard order (stage 0 holds the whole buffer)."""
    if engine.config.stage > 0:
        return [arr]
    return [arr[b.world_slice(engine.slot)] for b in engine.layout.buckets]


def _own_rows(engine):
    """This rank's shard-file contents, one host piece at a time: ROWS in order, each in shard order."""
    for row in ROWS:
        for piece in _own_pieces(engine, engine.optimizer.read_row(row)):
            yield _to_host(piece)


def _to_host(arr) -> np.ndarray:
    return arr.get() if hasattr(arr, "get") else np.asarray(arr)


# ---- load -------------------------------------------------------------------------
def load(engine, path: str) -> LoadInfo:
    """Restore ``engine`` from a checkpoint saved at any world size, stage or bucket size (a collective).

    ``path``: a checkpoint directory or a save directory (its ``latest`` is used). Restores
    the fp32 master, exp_avg and exp_avg_sq, the step counters and (same dtype only) the
    loss scaler, then republishes the stored parameters from the master. The ranks share the
    checksumming and agree on one verdict: on bad input every rank raises CheckpointError.
    """
    comm = engine.comm
    ckpt = manifest = saved = None
    try:
        ckpt = resolve(path)
        manifest, saved = read_manifest(ckpt)
        check_model(ckpt, saved, engine.layout)
        for r in range(engine.rank, saved.world_size, engine.world_size):
            verify_shard(ckpt, manifest, r)
        err = None
    except Exception as e:  # any failure must reach the agreement below, or the other ranks hang
        err = str(e) if isinstance(e, CheckpointError) else f"{path}: {type(e).__name__}: {e}"
    _agree(comm, err, "checkpoint load: agreement on the manifest and checksums")
    try:
        nbytes, err = _restore(engine, ckpt, saved), None
    except Exception as e:
        nbytes, err = 0, f"{ckpt}: reading the shards failed on rank {engine.rank}: {type(e).__name__}: {e}"
    _agree(comm, err, "checkpoint load: agreement on the shard reads")
    engine.steps_taken = manifest["step"]
    engine.step_count = manifest["optimizer"]["step"]
    if manifest["dtype"] == engine.config.dtype:   # fp32 runs have no loss scale to carry over
        engine.scaler.load_state_dict(manifest["loss_scaler"])
    engine.publish_params()
    return LoadInfo(ckpt, manifest, nbytes)


def _agree(comm, err: Optional[str], op: str) -> None:
    """One small collective: if any rank failed, every rank raises the first failure (in rank order).

    ``comm``: the engine's Communicator; the all-gather is timed by the watchdog as ``op``.
    """
    with watched(comm, op):
        errors = comm.mpi.allgather(err)
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointError(first)


def copy_plan(saved: SavedLayout, layout, rank: int, stage: int) -> List[Tuple[int, int, int, int]]:
    """Runs ``(dst, old_slice, src, numel)`` that fill the optimizer buffers of the rank holding
    slice ``rank`` of every bucket from the old shards (shard file i: slice i).

    ``dst`` indexes the engine's buffer (stage 0: the world buffer; else the shard), ``src``
    the old rank's shard. Adjacent runs are merged. Padding is not covered (it stays zero).
    """
    runs: List[List[int]] = []
    for bucket in layout.buckets:
        lo, hi = (0, bucket.numel) if stage == 0 else bucket.slice_bounds(rank)
        base = bucket.start if stage == 0 else bucket.shard_start
        for layer in bucket.layers:
            for name in layout.layer_params[layer]:
                pr = layout.params[name]
                a, z = max(lo, pr.bucket_offset), min(hi, pr.bucket_offset + pr.numel)
                if a < z:
                    _locate(saved, name, a - pr.bucket_offset, z - a, base + a - lo, runs)
    return [tuple(r) for r in runs]


def _locate(saved: SavedLayout, name: str, offset: int, numel: int, dst: int, runs: list) -> None:
    """Append the old-shard pieces of elements [offset, offset + numel) of parameter ``name``."""
    pr = saved.params[name]
    bucket = saved.buckets[pr.bucket]
    x, end = pr.bucket_offset + offset, pr.bucket_offset + offset + numel
    while x < end:
        r = x // bucket.slice_numel
        lo, hi = bucket.slice_bounds(r)
        n = min(end, hi) - x
        src = bucket.shard_start + x - lo
        last = runs[-1] if runs else None
        if last and last[1] == r and last[0] + last[3] == dst and last[2] + last[3] == src:
            last[3] += n
        else:
            runs.append([dst, r, src, n])
        x, dst = x + n, dst + n


def _restore(engine, ckpt: str, saved: SavedLayout) -> int:
    runs = copy_plan(saved, engine.layout, engine.slot, engine.config.stage)
    shards: Dict[int, np.ndarray] = {}
    nbytes = 0
    for k, row in enumerate(ROWS):
        host = np.zeros(engine.optimizer.n, F32)   # the row, wherever it lives (device, host, file)
        for dst, r, src, n in runs:
            if r not in shards:   # memory-mapped: only the pages of the pieces copied are read
                shards[r] = np.load(os.path.join(ckpt, shard_file(r)), mmap_mode="r")
            host[dst:dst + n] = shards[r][k, src:src + n]
            nbytes += 4 * n
        engine.optimizer.write_row(row, host, engine.xp)
    return nbytes

