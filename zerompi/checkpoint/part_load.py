"""Loading one engine from several checkpoints of one step: each parameter's elements from where a map says.

An expert-parallel save (``DIR`` the dense engine's checkpoints, ``DIR/ep{j}-of-{K}`` EP rank j's experts) is
resumed at another ``--ep``: an engine's parameter is then pieces of several saved parameters. ``sources(name,
shape)`` gives, per parameter, segments ``(part, saved name, lo, hi, saved offset)``: the engine's flat elements
[lo, hi) are the saved parameter's from ``saved offset`` on, in checkpoint ``part``. The rest is collective.load's:
the pieces of the old shards located through each part's saved layout (so the world size, stage and bucket size
may change too), the shards checksummed first, every rank agreeing on one verdict, then the rows copied by name.
"""
import os
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from .collective import LoadInfo, _agree, _locate, between_steps, check_optimizer, finish, settle
from .format import F32, CheckpointError, read_manifest, shard_file, verify_shard
from .state_rows import engine_rows, optimizer_name, saved_rows

Segment = Tuple[int, str, int, int, int]        # (part, saved name, lo, hi, saved offset)


def load_parts(engine, ckpts: List[str], sources: Callable[[str, tuple], List[Segment]],
               save_folder: Optional[str] = None) -> LoadInfo:
    """Restore ``engine`` from the checkpoint directories ``ckpts`` (resolved, one step; the first gives the
    step counters and the loss scale) through ``sources`` (a collective over the engine's group).
    ``save_folder``: where this engine saves into (default: the first's save folder); its checkpoints of later
    steps are never removed by its saves there (collective.kept)."""
    between_steps(engine, "load")
    finish(engine)
    comm = engine.comm
    parts = err = None
    try:
        parts = [read_manifest(c) for c in ckpts]
        steps = sorted({m["step"] for m, _ in parts})
        if len(steps) > 1:
            raise CheckpointError(f"{ckpts[0]}: its parts are of different steps ({', '.join(map(str, steps))}: "
                                  + ", ".join(f"{c} step {m['step']}" for c, (m, _) in zip(ckpts, parts))
                                  + "); resume a step that every part saved")
        for c, (m, _) in zip(ckpts, parts):
            check_optimizer(c, m, engine)
        _check_sources(ckpts, parts, engine.layout, sources)
        for c, (m, saved) in zip(ckpts, parts):
            for r in range(engine.rank, saved.world_size, engine.world_size):
                verify_shard(c, m, r)
    except Exception as e:   # every failure reaches the agreement, or the other ranks hang
        err = str(e) if isinstance(e, CheckpointError) else f"{ckpts[0]}: {type(e).__name__}: {e}"
    _agree(comm, err, "checkpoint load: agreement on the manifests and checksums")
    return settle(engine, lambda: _restore(engine, ckpts, parts, sources), ckpts[0], parts[0][0],
                  save_folder or os.path.dirname(ckpts[0]))


def _check_sources(ckpts, parts, layout, sources) -> None:
    """CheckpointError unless every element of every parameter comes from a saved parameter that has it."""
    for name, pr in layout.params.items():
        covered = 0
        for part, there, lo, hi, off in sources(name, pr.shape):
            saved = parts[part][1].params.get(there)
            if saved is None or off + hi - lo > saved.numel or lo != covered:
                raise CheckpointError(f"{os.path.join(ckpts[part], 'manifest.json')}: saved from another model "
                                      f"(no parameter {there!r} holding elements {lo}..{hi} of {name!r} "
                                      f"{pr.shape}); use the same model flags")
            covered = hi
        if covered != pr.numel:
            raise CheckpointError(f"{ckpts[0]}: saved from another model ({name!r} {pr.shape} is not whole "
                                  "there); use the same model flags")


def copy_plan(parts, layout, sources, rank: int, stage: int) -> List[Tuple[int, int, int, int, int]]:
    """Runs ``(part, dst, old_slice, src, numel)`` that fill the buffers of the rank holding slice ``rank``
    (collective.copy_plan's, each run from one of several checkpoints)."""
    runs: List[Tuple[int, int, int, int, int]] = []
    for bucket in layout.buckets:
        lo, hi = (0, bucket.numel) if stage == 0 else bucket.slice_bounds(rank)
        base = bucket.start if stage == 0 else bucket.shard_start
        for layer in bucket.layers:
            for name in layout.layer_params[layer]:
                pr = layout.params[name]
                a, z = max(lo, pr.bucket_offset) - pr.bucket_offset, min(hi, pr.bucket_offset + pr.numel) \
                    - pr.bucket_offset
                for part, there, s_lo, s_hi, off in sources(name, pr.shape) if a < z else ():
                    x, y = max(a, s_lo), min(z, s_hi)
                    if x < y:
                        found: list = []
                        _locate(parts[part][1], there, off + x - s_lo, y - x, base + pr.bucket_offset + x - lo, found)
                        runs += [(part, *r) for r in found]
    return runs


def _restore(engine, ckpts, parts, sources) -> int:
    runs = copy_plan(parts, engine.layout, sources, engine.slot, engine.config.stage)
    shards: Dict[Tuple[int, int], np.ndarray] = {}
    nbytes = 0
    ours = optimizer_name(engine)
    for row in engine_rows(engine):
        host = np.zeros(engine.optimizer.n, F32)
        for part, dst, r, src, n in runs:
            manifest = parts[part][0]
            there = saved_rows(manifest)
            same = manifest["optimizer"].get("name", "adamw") == ours
            if row not in there or not (same or row == "master"):
                continue
            if (part, r) not in shards:
                shards[part, r] = np.load(os.path.join(ckpts[part], shard_file(r)), mmap_mode="r")
            host[dst:dst + n] = shards[part, r][there.index(row), src:src + n]
            nbytes += 4 * n
        engine.optimizer.write_row(row, host, engine.xp)
    return nbytes
