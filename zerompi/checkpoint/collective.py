"""Sharded checkpoints, the collective protocol: every rank saves its slices and loads its new ones.

One concern: what each rank writes and reads, and how the ranks agree, in ``save`` (with
``poll`` and ``finish`` for a save written in the background) and ``load`` (collectives over
the engine's communicator, each one timed by the watchdog, all on the main thread).
Loading maps every parameter through the saved layout, so the world size, stage and
bucket size may all change; :func:`copy_plan` gives the pieces of the old shards that make
up a rank's new slices, and each rank reads only those.

The files themselves (manifest, checksums, the atomic move of ``latest``) are format.py's,
the writing of a shard file (now or on a thread) writer.py's, retention savedir.py's; the
offline tools (``python -m zerompi.checkpoint``) are cli.py's.
"""
import json
import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from ..comm.consistency import rank_set
from ..comm.simulated_world import simulated
from ..comm.watchdog import watched
from ..errors import ConfigError, MismatchError, UsageError, at_abort
from .format import (F32, CheckpointError, SavedLayout, build_manifest, check_model, crash_point,
                     make_temp_dir, read_manifest, remove_dir, resolve, shard_file, verify_shard, wait_removals)
from .orphans import recover
from .state_rows import engine_rows, optimizer_name, saved_rows
from .pointer import complete_checkpoints, step_of
from .writer import PendingSave, free_snapshot

PENDING = "_checkpoint_pending"      # the engine attribute holding the save under way (or None)
KEPT = "_checkpoint_kept"            # (real save folder, names): what load() found newer than the checkpoint it read
STATE_CODES = {"busy": 0, "done": 1, "failed": 2, "published": 3}   # PendingSave.state()[0], as poll sends it


@dataclass(frozen=True)
class LoadInfo:
    """What :func:`load` restored."""
    path: str          # the checkpoint directory that was read
    manifest: dict     # its manifest (``manifest["extra"]`` is the caller's extra_state)
    bytes_read: int    # bytes of shard data this rank copied (checksumming not counted)


def between_steps(engine, what: str) -> None:
    """UsageError unless ``engine`` is open and between steps; then completes its in-flight collectives
    (and frees stage 3's gathered buckets, which would go stale when a load changes the master)."""
    engine._check_open()
    if simulated(engine.comm):
        raise UsageError(f"{what}() is not available on a simulated world (comm/simulated_world.py): this process "
                         "is one rank of the job, the others are stand-ins, so there is no whole checkpoint to write "
                         "or read")
    if engine.reducer.mid_step or engine.gatherer.held:
        raise UsageError(f"{what}() in the middle of a step (micro-batches handed back or layers "
                         "unsharded); call it after step()")
    engine.synchronize()
    engine.optimizer.wait()              # a delayed update in flight writes the rows a checkpoint reads
    if engine.config.stage == 3:
        engine.gatherer.free()


# ---- save -------------------------------------------------------------------------
def save(engine, directory: str, extra_state: Optional[dict] = None, blocking: bool = True,
         keep_last: Optional[int] = None):
    """Write ``engine``'s state as ``directory``/step_NNNNNN/ and point ``directory``/latest at it.

    A collective: the ranks of the first shard group write one shard file each, named by the
    slice of every bucket they hold (the other groups hold copies), rank 0 the manifest.
    NNNNNN is ``engine.steps_taken``. ``extra_state``: JSON-able dict stored as
    ``manifest["extra"]``. Every rank sees ``directory`` (a shared file system).

    ``blocking``: write, agree and publish now; returns the new checkpoint's directory.
    Else each rank copies its shard to host memory and a background thread writes it; returns
    a :class:`~zerompi.checkpoint.writer.PendingSave` at once. The checkpoint is published
    (``latest`` moved) by rank 0 in the background too, after a ``step()`` found every rank's
    file complete (:func:`poll`), or at the next save, ``close()`` or ``PendingSave.wait()``,
    which wait for it. A failed write raises CheckpointError on every rank at the next of
    these. ``keep_last``: after publication, remove all but the newest ``keep_last``
    checkpoints (savedir.retain); None keeps them all. Checkpoints of later steps than the one
    this engine loaded from ``directory`` are never removed (:func:`kept`).
    """
    whole = isinstance(keep_last, int) and not isinstance(keep_last, bool)
    if keep_last is not None and not (whole and keep_last >= 1):
        raise ConfigError(f"save(keep_last={keep_last!r}) is not allowed; use a whole number >= 1 of checkpoints "
                         "to keep, or None to keep them all")
    between_steps(engine, "save")
    finish(engine)                       # the previous background save first
    comm, rank, step = engine.comm, engine.rank, engine.steps_taken
    engine.guard.at("save", step)        # ZEROMPI_FAULT=KIND@rankR:stepS:save (engine/faults.py)
    tmp = err = manifest = None
    if rank == 0:
        try:
            manifest = build_manifest(engine, [], extra_state)
            json.dumps(manifest)         # extra_state must be JSON: found before anything is written
            recover(directory)           # a complete checkpoint a job that ended left unpublished: published, not lost
            tmp = make_temp_dir(directory, step)
        except OSError as e:
            err = f"cannot create a checkpoint in {directory}: {e}"
        except (TypeError, ValueError) as e:
            err = f"extra_state cannot be stored in the manifest as JSON: {e}"
    # Each collective is timed by the watchdog: a rank that dies or hangs in a save ends the job.
    # One all-gather: rank 0's temporary directory, and every rank's arguments (which must agree: a save
    # blocking on one rank and in the background on another would pair the wrong collectives and hang).
    with watched(comm, "checkpoint save: agreement on the arguments and the temporary directory", step):
        everyone = comm.mpi.allgather((tmp, err, bool(blocking), keep_last))
    tmp, err = everyone[0][:2]
    for i, name in ((2, "blocking"), (3, "keep_last")):
        seen: Dict[object, List[int]] = {}
        for r, args in enumerate(everyone):
            seen.setdefault(args[i], []).append(r)
        if len(seen) > 1:
            if rank == 0 and tmp:
                remove_dir(tmp)
            raise MismatchError("ranks called save() with different arguments: " + ", ".join(
                f"{name}={v!r} on {rank_set(rs)}" for v, rs in seen.items()) + "; every rank must pass the same")
    if err:
        raise CheckpointError(err)
    pending = PendingSave(engine, directory, tmp, step, manifest, keep_last, finish, kept(engine, directory))
    if not blocking:
        pending.start()                  # the host copy and the write on a thread
        setattr(engine, PENDING, pending)
        at_abort(pending.salvage)        # the job aborted before it was published: publish it if complete
        return pending
    pending.write_now()
    crash_point("after_shards", step)
    return _advance(engine, pending, _states(engine, pending), wait=True)


def poll(engine) -> None:
    """At a step boundary, while a background save is under way (else nothing, no collective): wait
    for this rank's host copy, then one Allgather of a byte per rank (busy, done, failed,
    published). Once every shard file is complete rank 0 publishes it (manifest, rename,
    ``latest``, retention) on a background thread too; the poll that sees it published tells
    every rank the path. A rank's failure is raised on every rank (CheckpointError)."""
    pending = getattr(engine, PENDING, None)
    if pending is None:
        return
    pending.wait_copied()                # the update that follows may change what is being copied
    # Each step: one byte per rank (one Allgather); the pickled states only once none is busy or one failed.
    mine = np.array([STATE_CODES[pending.state()[0]]], np.int8)
    codes = np.empty(engine.comm.size, np.int8)
    with watched(engine.comm, "checkpoint save: agreement on the shard files", pending.step):
        engine.comm.mpi.Allgather(mine, codes)
    if (codes == STATE_CODES["busy"]).any() and not (codes == STATE_CODES["failed"]).any():
        return
    _advance(engine, pending, _states(engine, pending), wait=False)


def finish(engine, release: bool = False) -> Optional[str]:
    """Wait for the background save (a collective) and publish it; returns its path, or None when
    none was under way. ``release``: also free the host buffer of asynchronous saves (close())."""
    pending = getattr(engine, PENDING, None)
    if pending is not None:
        pending.join()
        _advance(engine, pending, _states(engine, pending), wait=True)
    wait_removals()                      # retention's deletions (rank 0) finish before a save or close
    if release:
        free_snapshot(engine)
    return pending.path if pending is not None else None


def salvage(engine) -> List[str]:
    """After a failure, with a background save under way: wait for this rank's write, then publish the save
    once every shard file of it is complete (PendingSave.recovered: the other ranks' writes may end later;
    no collective: any rank, alone, so also where the ranks no longer meet). Returns what was published,
    one line each (on the rank that did it)."""
    pending = getattr(engine, PENDING, None)
    if pending is None:
        return []
    pending.join()
    return pending.recovered()


def _settled(engine, pending: PendingSave) -> None:
    setattr(engine, PENDING, None)
    at_abort(pending.salvage, add=False)


def _states(engine, pending: PendingSave) -> list:
    with watched(engine.comm, "checkpoint save: agreement on the shard files", pending.step):
        return engine.comm.mpi.allgather(pending.state())


def _advance(engine, pending: PendingSave, states: list, wait: bool) -> Optional[str]:
    """Move a save on, on every rank alike (``states``: every rank's PendingSave.state()).

    A rank failed: every rank waits for its own thread, rank 0 removes the temporary directory,
    every rank raises the first failure. A thread still busy: nothing yet (never when ``wait``:
    every rank joined its thread). Every shard complete: with ``wait``, rank 0 publishes now and
    broadcasts the result; else rank 0 starts publishing in the background. Published: done.
    Returns the published path, or None while the save goes on.
    """
    comm, rank, step = engine.comm, engine.rank, pending.step
    failures = [s[1] for s in states if s[0] == "failed"]
    if failures:
        _settled(engine, pending)
        pending.join()
        with watched(comm, "checkpoint save: agreement that every write stopped", step):
            comm.mpi.allgather(None)
        if rank == 0:
            remove_dir(pending.tmp)
        pending.error = (f"{failures[0]}; the checkpoint of step {step} was not saved "
                         f"({pending.directory}/latest is unchanged)")
        raise CheckpointError(pending.error)
    if any(s[0] == "busy" for s in states):
        return None
    path = next((s[1] for s in states if s[0] == "published"), None)
    if path is None and not wait:
        if rank == 0:
            pending.start_publish(states)
        return None
    _settled(engine, pending)
    if path is None:
        result = None
        if rank == 0:
            try:
                result = (pending.publish(states), None)
            except OSError as e:
                result = (None, f"cannot finish the checkpoint {pending.tmp}: {e}")
        with watched(comm, "checkpoint save: broadcast of the result (manifest written, latest moved)", step):
            path, err = comm.mpi.bcast(result, root=0)
        if err:
            pending.error = err
            raise CheckpointError(err)
    pending.path = path
    return path


# ---- load -------------------------------------------------------------------------
def load(engine, path: str) -> LoadInfo:
    """Restore ``engine`` from a checkpoint saved at any world size, stage or bucket size (a collective).

    ``path``: a checkpoint directory or a save directory (its ``latest`` is used). Restores
    the fp32 master, exp_avg and exp_avg_sq, the step counters and (same dtype only) the
    loss scaler, then republishes the stored parameters from the master. The ranks share the
    checksumming and agree on one verdict: on bad input every rank raises CheckpointError.
    """
    between_steps(engine, "load")
    finish(engine)                       # a background save copies and writes the state it replaces
    comm = engine.comm
    ckpt = manifest = saved = None
    try:
        ckpt = resolve(path)
        manifest, saved = read_manifest(ckpt)
        check_model(ckpt, saved, engine.layout)
        check_optimizer(ckpt, manifest, engine)
        for r in range(engine.rank, saved.world_size, engine.world_size):
            verify_shard(ckpt, manifest, r)
        err = None
    except Exception as e:  # any failure must reach the agreement below, or the other ranks hang
        err = str(e) if isinstance(e, CheckpointError) else f"{path}: {type(e).__name__}: {e}"
    _agree(comm, err, "checkpoint load: agreement on the manifest and checksums")
    return settle(engine, lambda: _restore(engine, ckpt, saved, manifest), ckpt, manifest, os.path.dirname(ckpt))


def settle(engine, restore: Callable[[], int], ckpt: str, manifest: dict, folder: str) -> LoadInfo:
    """The end of a load, once every rank agreed on the manifests: ``restore()`` reads this rank's shards
    (returns the bytes read), the ranks agree that every read succeeded, then the engine takes the
    manifest's step counters and (same dtype only) its loss scale, remembers the later checkpoints of its
    save ``folder`` (kept), and republishes the stored parameters from the master."""
    try:
        nbytes, err = restore(), None
    except Exception as e:
        nbytes, err = 0, f"{ckpt}: reading the shards failed on rank {engine.rank}: {type(e).__name__}: {e}"
    _agree(engine.comm, err, "checkpoint load: agreement on the shard reads")
    engine.steps_taken = manifest["step"]
    engine.step_count = manifest["optimizer"]["step"]
    folder = os.path.realpath(folder)     # its save folder: what is newer there is never removed
    setattr(engine, KEPT, (folder, tuple(n for n in complete_checkpoints(folder)
                                         if (step_of(n) or -1) > manifest["step"])))
    if manifest["dtype"] == engine.config.dtype:   # fp32 runs have no loss scale to carry over
        engine.scaler.load_state_dict(manifest["loss_scaler"])
    engine.publish_params()
    return LoadInfo(ckpt, manifest, nbytes)


def kept(engine, directory: str) -> tuple:
    """The checkpoints a save into ``directory`` never removes (retention, the replacement of one of the
    same step): those of later steps than the checkpoint ``engine`` last loaded from this folder, found
    there at the load (the future of the run it resumed; the train CLI's --overwrite removes them)."""
    folder, names = getattr(engine, KEPT, (None, ()))
    return names if folder == os.path.realpath(directory) else ()


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


def check_optimizer(ckpt: str, manifest: dict, engine) -> None:
    """CheckpointError when the checkpoint's optimizer is not the engine's, unless the config's
    ``fresh_optimizer_state`` starts the state fresh."""
    theirs, ours = manifest["optimizer"].get("name", "adamw"), optimizer_name(engine)
    if theirs != ours and not engine.config.fresh_optimizer_state:
        raise CheckpointError(f"{ckpt}: saved by optimizer {theirs!r}, this run's is {ours!r}; use --optimizer "
                              f"{theirs}, or add --fresh-optimizer-state to load its parameters and start "
                              f"{ours}'s state at zero")


def _restore(engine, ckpt: str, saved: SavedLayout, manifest: dict) -> int:
    """The engine's rows from the checkpoint's, by name: every row of the same optimizer, only the
    master of another (its state then zero)."""
    runs = copy_plan(saved, engine.layout, engine.slot, engine.config.stage)
    shards: Dict[int, np.ndarray] = {}
    nbytes = 0
    same = manifest["optimizer"].get("name", "adamw") == optimizer_name(engine)
    there = saved_rows(manifest)
    for row in engine_rows(engine):
        host = np.zeros(engine.optimizer.n, F32)   # the row, wherever it lives (device, host, file)
        k = there.index(row) if row in there and (same or row == "master") else None
        for dst, r, src, n in runs if k is not None else ():
            if r not in shards:   # memory-mapped: only the pages of the pieces copied are read
                shards[r] = np.load(os.path.join(ckpt, shard_file(r)), mmap_mode="r")
            host[dst:dst + n] = shards[r][k, src:src + n]
            nbytes += 4 * n
        engine.optimizer.write_row(row, host, engine.xp)
    return nbytes

