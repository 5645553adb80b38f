"""The train CLI's checkpoints: the save directory claimed at start, and the saves of the step loop.

:func:`claim_save_dir` (rank 0, before the start-up agreement): the ``--save-dir`` lock and the refusal to
save a fresh run over another run's checkpoints. :class:`Saves` (every rank): the ``--save-every`` and the
last step's saves, in the background with ``--async-save``, ``--keep-last`` and ``--overwrite`` applied.
"""
import atexit
import os
import sys
from typing import List, Optional

from ..checkpoint.state_rows import engine_rows
from ..checkpoint.orphans import recover
from ..checkpoint.savedir import SaveDirLock, check_fresh, newer_checkpoints, own_folder, replace, saved_checkpoints
from ..errors import at_abort
from .config import TrainConfig

HEADER_BYTES = 128       # a shard file's .npy header


def claim_save_dir(cfg: TrainConfig, rank: int) -> Optional[SaveDirLock]:
    """Rank 0: lock cfg.save_dir for this job (released at exit), publish what a job that ended left
    complete but unpublished there (orphans.recover), and refuse a run into a directory holding another
    run's checkpoints (unless --overwrite: savedir.check_fresh). Raises ConfigError (one line)."""
    if rank != 0 or not cfg.save_dir:
        return None
    lock = SaveDirLock(cfg.save_dir).acquire()
    atexit.register(lock.release)
    at_abort(lock.release)                     # an error that aborts the job skips atexit: released here first
    if lock.note:
        sys.stderr.write(f"zerompi.train: note: {lock.note}\n")
    try:
        for line in recover(cfg.save_dir):     # a job that ended left a complete checkpoint unpublished
            sys.stderr.write(f"zerompi.train: note: {line}\n")
        from .replicas import continues_job     # a relaunch from the replicas continues the run saved there
        check_fresh(cfg.save_dir, cfg.save_dir if continues_job(cfg) else cfg.resume, cfg.overwrite)
    except BaseException:
        lock.release()
        at_abort(lock.release, add=False)
        raise
    return lock


def checkpoint_bytes(engine) -> int:
    """Bytes of one checkpoint's shard files: one per slice, rows x shard_numel float32 each (the manifest,
    a few KB per parameter tensor, comes on top). Equal to the optimizer bytes per rank of stages 1-3 times
    the shard-group size, whatever the stage."""
    lay = engine.layout
    return lay.world_size * (HEADER_BYTES + 4 * len(engine_rows(engine)) * lay.shard_numel)


def disk_line(cfg: TrainConfig, engine, start: int) -> str:
    """What the run's checkpoints take on disk, for the banner."""
    from .console import human_bytes
    every = cfg.save_every
    saves = len({s for s in range(start + 1, cfg.steps + 1) if every and s % every == 0} | {cfg.steps})
    one = sum(k * checkpoint_bytes(e) for e, k in getattr(engine, "saved_engines", lambda: [(engine, 1)])())
    held = saves if not cfg.keep_last else min(saves, cfg.keep_last + 1)
    keep = f"--keep-last {cfg.keep_last}: at most {held} at once (the kept ones and the one being written)" \
        if cfg.keep_last else "all kept"
    return (f"  checkpoints: {human_bytes(one)} each (12 bytes per padded parameter), {saves} this run, {keep}: "
            f"up to {human_bytes(held * one)} in {cfg.save_dir}" + (", plus a host copy of each rank's shard"
                                                                   if cfg.async_save else ""))


class Saves:
    """The step loop's checkpoints (every rank): ``after_step`` after each step, ``finish`` at the end."""

    def __init__(self, cfg: TrainConfig, engine, mpi):
        self.cfg, self.engine, self.mpi = cfg, engine, mpi
        self.pending = None                 # the background save under way
        # --overwrite: the other run's checkpoints (resumed into its own folder: those newer than the one it
        # resumed from), removed once this run's first one is published.
        self.replace: List[str] = []
        self.whole = False                  # --overwrite of another run: its folders of another layout go too
        if cfg.save_dir and mpi.Get_rank() == 0:
            newer = newer_checkpoints(cfg.save_dir, engine.steps_taken) if own_folder(cfg.save_dir, cfg.resume) \
                else None
            if cfg.overwrite:
                self.replace = saved_checkpoints(cfg.save_dir) if newer is None else newer
                self.whole = newer is None        # another run's folder: all of that run goes, any layout
            if newer:
                fate = ("--overwrite: they are removed once this run's first checkpoint is saved" if cfg.overwrite
                        else "this run keeps them (--keep-last never removes them; --overwrite would replace them)")
                from .report import print0
                print0(mpi, f"  note: {cfg.save_dir} holds checkpoints of later steps than the one resumed from "
                            f"(step {engine.steps_taken}): {', '.join(newer)}; {fate}")

    def after_step(self, done: int, stopping: bool) -> None:
        """After step ``done`` (1-based): announce a background save published meanwhile, save when due."""
        from .report import print0
        cfg = self.cfg
        self._announce()
        last = done == cfg.steps or stopping
        if not cfg.save_dir or not (last or (cfg.save_every and done % cfg.save_every == 0)):
            return
        # The data is a function of (seed, step): the next step is the whole data position.
        extra = {"data_step": done, "seed": cfg.seed}
        if cfg.model == "gpt":                 # what its shapes do not tell, for export-hf (checkpoint/hf_export.py)
            extra["gpt"] = {"n_head": cfg.n_head}
        if cfg.async_save and not last:        # a save first waits for the previous one, published then
            pending = self.engine.save(cfg.save_dir, extra, blocking=False, keep_last=cfg.keep_last)
            self._announce()
            self.pending = pending
            print0(self.mpi, f"  saving checkpoint of step {done} in the background")
            return
        path = self.engine.save(cfg.save_dir, extra, keep_last=cfg.keep_last)
        self._announce()
        self._published(path, "")

    def finish(self) -> None:
        """At the end of the loop: wait for a background save and publish it."""
        if self.pending is not None:
            self.pending.wait()
            self._announce()

    def _announce(self) -> None:
        if self.pending is not None and self.pending.path:
            path, self.pending = self.pending.path, None
            self._published(path, " (written in the background)")

    def _published(self, path: str, how: str) -> None:
        from .report import print0
        print0(self.mpi, f"  saved checkpoint {path}{how}")
        if self.replace or self.whole:
            own = os.path.relpath(os.path.dirname(path), self.cfg.save_dir) if self.whole else None
            removed = replace(self.cfg.save_dir, self.replace, os.path.basename(path), own)
            self.replace, self.whole = [], False
            if removed:
                print0(self.mpi, f"  --overwrite: removed the earlier run's checkpoints {', '.join(removed)}")
