"""What a pipelined run measures of its schedule, summarized over the mesh (collectives), and its message formula.

- ``bubble``: per kept step, of each pipeline group (the P ranks sharing a data-parallel, SP and TP coordinate),
  1 - (the ranks' compute seconds in the schedule's actions) / (P x the schedule's span, from the first
  action's start to the last one's end, on a clock aligned over the mesh), averaged over the groups;
- ``costs``: the median compute seconds of each (kind, chunk) of action, which the simulator (timeline.py)
  is given to make the bubble the schedule would have on them;
- ``replayed``: per kept step, the simulator's bubble on that step's own costs (every action's, of each
  micro-batch, chunk and pipeline group), mean over the groups: the bubble the schedule itself makes of the
  costs as they were, with each stage's data-parallel waits (inside its actions: a micro-batch's gradient
  reduce waits for the stage's other data-parallel ranks) and the costs' spread from one action to the next
  (a slow action on one stage idles the other, which equal median costs never show); the measured bubble
  above it is what the executor adds between actions (message latency, sends' copies, polling);
- ``message_bytes``: the bytes a rank sends per step by kind of message, from its schedule and the sizes.
"""
from typing import Dict, List

import numpy as np

from ..comm.watchdog import watched
from . import timeline


def _groups(mesh, size: int) -> List[List[int]]:
    """The pipeline groups: the ranks sharing a data-parallel, SP and TP coordinate (one per stage)."""
    groups: Dict[tuple, List[int]] = {}
    for r in range(size):
        c = mesh.coords(r)
        groups.setdefault((c["dp"], c["sp"], c["tp"]), []).append(r)
    return list(groups.values())


def bubble(pp_times, mesh, comm) -> List[float]:
    """Per kept step (the first left out when more are kept): the measured bubble, mean over pipeline groups."""
    mine = [(min(t[1] for t in step), max(t[3] for t in step), sum(t[3] - t[2] for t in step)) if step else None
            for step in pp_times]
    with watched(comm, "final metrics: the schedule's times"):
        everyone = comm.mpi.allgather(mine)

    def one(ranks, k):
        spans = [everyone[r][k] for r in ranks if everyone[r][k] is not None]
        span = max(e for _, e, _ in spans) - min(s for s, _, _ in spans)
        return 1.0 - sum(b for _, _, b in spans) / (len(ranks) * span) if span > 0 else 0.0
    return _mean_per_step(len(mine), _groups(mesh, comm.size), one)


def replayed(pp_times, mesh, comm, schedule) -> List[float]:
    """Per kept step (the first left out when more are kept): the simulator's bubble (timeline.run) on that step's
    own compute seconds of every action ((kind, micro-batch, chunk) of each pipeline group), mean over groups."""
    mine = [{(a.kind, a.mb, a.chunk): end - ready for a, _, ready, end in step} for step in pp_times]
    with watched(comm, "final metrics: each action's seconds"):
        everyone = comm.mpi.allgather(mine)

    def one(ranks, k):
        cost = {key: t for r in ranks for key, t in everyone[r][k].items()}
        return timeline.run(schedule, lambda a: cost.get((a.kind, a.mb, a.chunk), 0.0)).bubble_fraction \
            if cost else None
    return _mean_per_step(len(mine), _groups(mesh, comm.size), one)


def _mean_per_step(steps: int, groups, one) -> List[float]:
    """Per kept step (the first left out when more are kept): the mean over pipeline ``groups`` of ``one(ranks,
    step)`` (None: the group has nothing that step; a step where none has, left out)."""
    out = []
    for k in range(1 if steps > 1 else 0, steps):
        values = [v for v in (one(ranks, k) for ranks in groups) if v is not None]
        if values:
            out.append(sum(values) / len(values))
    return out


def costs(pp_times, comm) -> Dict[tuple, float]:
    """{(kind, chunk): median compute seconds} over the kept steps (but the first) and every rank."""
    mine: Dict[tuple, List[float]] = {}
    for step in list(pp_times)[1 if len(pp_times) > 1 else 0:]:
        for a, _, ready, end in step:
            mine.setdefault((a.kind, a.chunk), []).append(end - ready)
    with watched(comm, "final metrics: the actions' costs"):
        everyone = comm.mpi.allgather(mine)
    merged: Dict[tuple, List[float]] = {}
    for table in everyone:
        for k, v in table.items():
            merged.setdefault(k, []).extend(v)
    return {k: float(np.median(v)) for k, v in merged.items()}


def message_bytes(schedule, rank: int, runners, tie=None, tied_numel: int = 0) -> Dict[str, int]:
    """Bytes pipeline rank ``rank`` sends per step by kind, from its schedule and the messages' sizes (``runners``:
    {chunk: runner} of the rank; ``tie``: the GPT's TiedWeight, whose value and gradient (``tied_numel``
    elements) go between the first and the last chunk's stages)."""
    out = {"activations": 0, "activation gradients": 0}
    for a in schedule.actions[rank]:
        if a.kind == "SEND_F":              # chunk c's output: the shape of its gradient
            shape, dt = runners[a.chunk].grad_spec(a.mb)
            out["activations"] += int(np.prod(shape)) * np.dtype(dt).itemsize
        elif a.kind == "SEND_B":
            shape, dt = runners[a.chunk].input_spec(a.mb)
            out["activation gradients"] += int(np.prod(shape)) * np.dtype(dt).itemsize
    if tie is not None:
        sent = 0
        if not tie.local and 0 in runners:
            sent += tied_numel * tie.value_dtype.itemsize
        if not tie.local and schedule.chunks - 1 in runners:
            sent += schedule.micro_batches * tied_numel * 4
        out["tied weight"] = sent
    return out
