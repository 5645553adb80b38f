"""The step over the whole mesh: every chunk's engine of every stage applies (or skips) the same step.

Each engine's ``begin_step`` completes its reductions and returns its gradient totals (sum of
squares, non-finite count), already summed over its data-parallel and tensor-parallel groups.
The totals of every chunk of every stage are then gathered over the pipeline group (the ranks
that share this rank's data-parallel and tensor-parallel coordinates) and summed in one fixed
order (stage, then chunk): every rank of the mesh gets the same bits, so the norm, the clip
coefficient, the fp16 overflow skip and the loss scale are decided once for the whole model.
The stages must be at the same step with the same learning rate: MismatchError on every rank,
naming the ranks, before any engine updates anything.
"""
from typing import Dict, List, Optional, Sequence

import numpy as np

from ..comm.consistency import rank_set
from ..comm.watchdog import watched
from ..errors import MismatchError


def step_together(engines: List, group, lr: Optional[float] = None, counted: Optional[Sequence[bool]] = None) -> List:
    """begin_step on each engine (in chunk order), one all-gather over ``group`` (an object with ``mpi``,
    the pipeline group's mpi4py communicator, and ``waiting``, the watchdog's record; ``ranks``: the world
    rank of each member, for messages), then finish_step on each with the mesh's totals. Returns the
    StepResults (the same decision in each). ``counted``: whether each of this rank's engines' totals count (default:
    all); an engine whose totals another member of the group holds too is counted on one of them only (expert
    parallelism's dense engine, the same on every EP rank: train/moe/expert_parallel.py)."""
    pendings = [e.begin_step(lr) for e in engines]
    counted = [True] * len(engines) if counted is None else list(counted)
    mine = np.array([[p.sumsq, p.nonfinite, p.lr, p.number, c] for p, c in zip(pendings, counted)],
                    np.float64).reshape(-1, 5)
    with watched(group, "pipeline: the step's gradient totals over the stages"):
        rows = group.mpi.allgather(mine)
    _check_agree(rows, getattr(group, "ranks", list(range(len(rows)))))
    sumsq = nonfinite = 0.0
    for table in rows:                  # stage order, then chunk order: the same sums on every rank
        for s, bad, _, _, count in table:
            if count:
                sumsq += float(s)
                nonfinite += float(bad)
    return [e.finish_step(p, (sumsq, nonfinite)) for e, p in zip(engines, pendings)]


def _check_agree(rows, ranks) -> None:
    for col, what, show in ((3, "the pipeline stages are at different steps", lambda v: f"step() call {int(v)}"),
                            (2, "the pipeline stages called step() with different learning rates",
                             lambda v: f"lr={v:g}")):
        seen: Dict[float, List[int]] = {}
        for r, table in zip(ranks, rows):
            for v in table[:, col].tolist():
                seen.setdefault(v, []).append(r)
        if len(seen) > 1:
            raise MismatchError(f"{what}: " + ", ".join(f"{show(v)} on {rank_set(sorted(set(rs)))}"
                                                          for v, rs in seen.items())
                                + "; every stage must step alike, with the same lr (and schedule)")
