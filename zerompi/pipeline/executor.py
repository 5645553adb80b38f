"""The executor: one rank's actions of a schedule, run through one ZeroEngine per model chunk.

The executor walks the rank's list in order. F, B and W call the chunk's runner (the model's
code for one chunk: its layers through its engine, exactly as an unpipelined model drives the
engine); RECV posts a non-blocking receive into a new buffer, and the F or B that needs the data
waits for it there, so the transfer overlaps whatever runs in between; SEND posts a non-blocking
send of a copy of the output (the runner may reuse its buffers for the next micro-batch). Between
actions the posted messages are moved on (``PointToPoint.poll``). The engines learn nothing about
the pipeline: each sees the forwards and backwards of its chunk's layers, micro-batch after
micro-batch.

A runner (a model chunk: train/models/chunks.py, gpt_chunk.py) provides::

    input_spec(mb) -> (shape, dtype)      # the activation it receives (chunk > 0)
    grad_spec(mb) -> (shape, dtype)       # the gradient of its output it receives (not the last chunk)
    forward(mb, x) -> y                   # chunk 0: x is None (it reads its data); the last: y is None
    backward(mb, dy, weights) -> dx       # the last chunk: dy is None; chunk 0: dx is None
    weights(mb)                           # split schedules: the weight gradients, handed to the engine
    begin_step(step) / end_step()         # around the step's actions

Timing: every compute action is timed (its wait for data apart from its compute), so that the
measured bubble and the per-action costs the simulator takes come from the same clock.
"""
import time
from typing import Dict, List, Optional

import numpy as np

from .actions import Action, Schedule

TAGS = {"F": 21, "B": 22}                 # the point-to-point streams: activations, their gradients
KINDS = {"F": "activations", "B": "activation gradients"}


class ActionTime:
    """One compute action's times on this rank's clock (seconds)."""

    __slots__ = ("action", "start", "ready", "end")

    def __init__(self, action: Action, start: float, ready: float, end: float):
        self.action, self.start, self.ready, self.end = action, start, ready, end   # ready: its data arrived

    @property
    def compute(self) -> float:
        return self.end - self.ready


class PipelineExecutor:
    """Rank ``comm.rank`` of the pipeline group: its actions of ``schedule``, its chunks' ``runners``
    ({chunk: runner}); ``comm`` a PointToPoint over the pipeline group (rank = stage).

    ``keep_gathered`` ({chunk: engine}, stage 3): hold each of those chunks' layers unsharded from the
    chunk's first action of the step to its last (gathered once per step instead of per micro-batch).
    """

    def __init__(self, schedule: Schedule, comm, runners: Dict[int, object], keep_gathered=None,
                 clock=time.perf_counter):
        self.schedule, self.comm, self.runners, self.clock = schedule, comm, runners, clock
        self.rank = comm.rank
        self.actions = schedule.actions[self.rank]
        self.where = schedule.placement()
        self.chunks = schedule.chunks
        self.split = schedule.split_backward
        self.keep = dict(keep_gathered or {})
        firsts, lasts = {}, {}
        for i, a in enumerate(self.actions):
            if a.kind in ("F", "B", "W"):
                firsts.setdefault(a.chunk, i)
                lasts[a.chunk] = i
        self.first_use, self.last_use = firsts, lasts
        self.times: List[ActionTime] = []       # the last step's compute actions, in order

    def _peer(self, chunk: int) -> int:
        return self.where[chunk]

    def run(self, step: int) -> List[ActionTime]:
        """Every action of this rank for step ``step`` (the engines' step() is the caller's, after this)."""
        posted: Dict[Action, object] = {}       # RECV action -> its message
        outputs: Dict[tuple, np.ndarray] = {}   # (F or B, mb, chunk) -> what a local neighbour reads next
        last = self.chunks - 1
        self.times = []
        for r in self.runners.values():
            r.begin_step(step)
        for i, a in enumerate(self.actions):
            self.comm.poll()
            if i in self.first_use.values():
                self._hold(a.chunk, i)
            k = a.kind
            if k in ("RECV_F", "RECV_B"):
                d = k[-1]
                runner = self.runners[a.chunk]
                shape, dtype = runner.input_spec(a.mb) if d == "F" else runner.grad_spec(a.mb)
                src = self._peer(a.chunk - 1 if d == "F" else a.chunk + 1)
                posted[a] = self.comm.irecv(np.empty(shape, dtype), src, TAGS[d], KINDS[d])
            elif k in ("SEND_F", "SEND_B"):
                d = k[-1]
                data = outputs.pop((d, a.mb, a.chunk))
                dst = self._peer(a.chunk + 1 if d == "F" else a.chunk - 1)
                self.comm.isend_copy(data, dst, TAGS[d], KINDS[d])
            elif k == "F":
                t0 = self.clock()
                x = None if a.chunk == 0 else self._incoming(posted, outputs, "F", a.mb, a.chunk, a.chunk - 1)
                t1 = self.clock()
                y = self.runners[a.chunk].forward(a.mb, x)
                if a.chunk < last:
                    outputs[("F", a.mb, a.chunk)] = y
                self.times.append(ActionTime(a, t0, t1, self.clock()))
            elif k == "B":
                t0 = self.clock()
                dy = None if a.chunk == last else self._incoming(posted, outputs, "B", a.mb, a.chunk, a.chunk + 1)
                t1 = self.clock()
                dx = self.runners[a.chunk].backward(a.mb, dy, not self.split)
                if a.chunk > 0:
                    outputs[("B", a.mb, a.chunk)] = dx
                self.times.append(ActionTime(a, t0, t1, self.clock()))
            elif k == "W":
                t0 = self.clock()
                self.runners[a.chunk].weights(a.mb)
                self.times.append(ActionTime(a, t0, t0, self.clock()))
            if i in self.last_use.values():
                self._release(a.chunk, i)
        self.comm.wait_all()                    # every send done: nothing in flight across the step's end
        for r in self.runners.values():
            r.end_step()
        return self.times

    def _incoming(self, posted, outputs, d: str, mb: int, chunk: int, src_chunk: int):
        """The data ``chunk`` needs from ``src_chunk`` (F: its output; B: its input gradient)."""
        if self._peer(src_chunk) == self.rank:
            return outputs.pop((d, mb, src_chunk))
        msg = posted.pop(Action("RECV_" + d, mb, chunk))
        return self.comm.wait(msg, f"pipeline: {KINDS[d]} of micro-batch {mb} for chunk {chunk} from stage "
                                   f"{self._peer(src_chunk)}")

    # ---- stage 3, gathered once per step ----------------------------------------------------
    def _hold(self, chunk: int, i: int) -> None:
        engine = self.keep.get(chunk)
        if engine is not None and self.first_use.get(chunk) == i:
            engine.begin_forward()
            for layer in range(engine.layout.num_layers):
                engine.unshard(layer)

    def _release(self, chunk: int, i: int) -> None:
        engine = self.keep.get(chunk)
        if engine is not None and self.last_use.get(chunk) == i:
            for layer in range(engine.layout.num_layers):
                engine.reshard(layer)


def measured_costs(times: List[ActionTime]) -> Dict[tuple, float]:
    """{(kind, chunk): median compute seconds} of these compute actions (the simulator's costs)."""
    by: Dict[tuple, List[float]] = {}
    for t in times:
        by.setdefault((t.action.kind, t.action.chunk), []).append(t.compute)
    return {k: float(np.median(v)) for k, v in by.items()}


def busy(times: List[ActionTime]) -> Optional[tuple]:
    """(first start, last end, compute seconds) of one step's actions, or None when there were none."""
    if not times:
        return None
    return times[0].start, max(t.end for t in times), sum(t.compute for t in times)
