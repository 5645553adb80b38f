"""The timeline of a run: every rank's compute and collectives, as a Chrome trace-event file.

``ZeroConfig(trace=PATH)`` (the train CLI: ``--trace PATH``) records what the engine does on
every rank, and when; ``engine.close()`` (the train CLI: after the final metrics) gathers the
ranks' events and rank 0 writes PATH, which Perfetto (ui.perfetto.dev) and chrome://tracing
open. One process per rank ("rank R"), and in it these tracks (threads):

  step        one span per step, from the engine's first call of the step to the end of
              step(); its args hold the engine's own timers over the same window
              (engine/timers.py: timers_comm_busy_ms, timers_comm_wait_ms)
  compute     ``forward NAME`` / ``backward NAME`` while layer NAME is held unsharded (cut where
              the engine runs inside), ``optimizer bK`` (AdamW on bucket K's rows), ``local sum
              bK`` (a reduce-scatter's fp32 sum; ``finish OP bK`` for the other collectives)
  wait        the training thread inside MPI: ``start`` and ``test`` of collectives, ``wait OP bK``
              (blocked until one arrives) and the blocking collectives (exposed communication)
  comm K      each collective from the call that starts it (B) to the test or wait that sees it
              complete (E), args op, bucket, step and bytes (sent by this rank); collectives in
              flight at once take lanes 0, 1, ...
  optimizer (background)   the buckets of the delayed update (offload_delayed_update)

Timestamps are microseconds of rank 0's clock since the engine started: at start every rank
measures its clock's offset against rank 0's (the ping-pong of least round trip of ROUNDS).
Bounded: the events of the last ``trace_steps`` steps (a ring) and those of the step in
progress. Off (the default), each hook in the engine is one ``is None`` test.

At a crash, what there is: an error every rank raises together (JobError) still lets the
ranks merge (the train CLI does); a rank that aborts the job (an exception of its own, a
collective timeout) first writes its own events, rank 0 to PATH, rank R to ``crash_path``.
"""
import json
import os
import sys
import time
import weakref
from collections import deque
from typing import Optional

import numpy as np

from ..checkpoint.outputs import check_file, save_bytes
from ..comm.watchdog import watched
from ..errors import at_abort
from .phase import Phase

CLOCK = time.perf_counter      # the trace's clock (read when a Tracer is made: a test may skew it)
ROUNDS = 16                    # ping-pongs per rank when the clocks are aligned
TAG = 0x7A60                   # their MPI tag (on a duplicate of the engine's communicator)
STEP, COMPUTE, WAIT, BACKGROUND, LANE0 = 0, 1, 2, 3, 10     # thread ids of the tracks
TRACKS = {STEP: "step", COMPUTE: "compute", WAIT: "wait (in MPI)", BACKGROUND: "optimizer (background)"}
CATEGORY = {STEP: "step", COMPUTE: "compute", WAIT: "wait", BACKGROUND: "compute"}


def attach(engine) -> "Tracer":
    """A Tracer for ``engine`` (its config.trace is set), hooked into its parts (a collective: the clocks)."""
    me = weakref.ref(engine)      # the tracer must not keep a forgotten engine alive
    # With tensor parallelism every rank of the mesh goes into the one file (each DP group's rank 0 would write it).
    comm = engine.tp.world_view(engine.comm) if engine.tp is not None else engine.comm
    tracer = Tracer(engine.config.trace, engine.config.trace_steps, comm, engine.timers, engine.layout,
                    lambda: me().steps_taken + 1 if me() is not None else None)
    tracer.parts = [engine.timers, engine.inflight, engine.gatherer, engine.optimizer]
    for part in tracer.parts:
        part.trace = tracer
    return tracer


def crash_path(path: str, rank: int) -> str:
    """Where rank ``rank`` writes its own events at a crash: PATH itself on rank 0, else
    ``trace.json`` -> ``trace.rank3.json``."""
    if rank == 0:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext or '.json'}"


def align_clocks(comm, clock):
    """(offset, round trip) of this rank's clock against rank 0's in seconds (rank 0's time =
    ``clock() + offset``), and rank 0's clock now, the trace's zero. A collective."""
    if comm.size == 1:
        return 0.0, 0.0, clock()
    buf, best = np.zeros(1), (float("inf"), 0.0)
    with watched(comm, "trace: aligning the clocks with rank 0"):
        dup = comm.mpi.Dup()          # private: these messages never match anything else
        try:
            if comm.rank == 0:
                for r in range(1, comm.size):
                    for _ in range(ROUNDS):
                        dup.Recv(buf, source=r, tag=TAG)
                        buf[0] = clock()
                        dup.Send(buf, dest=r, tag=TAG)
            else:
                for _ in range(ROUNDS):
                    t0 = clock()
                    dup.Send(buf, dest=0, tag=TAG)
                    dup.Recv(buf, source=0, tag=TAG)
                    t1 = clock()
                    if t1 - t0 < best[0]:      # the least round trip bounds the error best
                        best = (t1 - t0, float(buf[0]) - (t0 + t1) / 2)
            zero = np.array([clock() if comm.rank == 0 else 0.0])
            dup.Bcast(zero, root=0)
        finally:
            dup.Free()
    return (best[1], best[0], float(zero[0])) if comm.rank else (0.0, 0.0, float(zero[0]))


def _bucket_step(tag):
    """(bucket, step) from a collective's tag: (bucket, step) as the engine labels them, or a bare bucket."""
    return (tag[0], tag[1]) if isinstance(tag, tuple) else (tag, None)


class Tracer:
    """One rank's events. Spans are ("X", track, name, t0, t1, args); a collective is
    ["C", lane, name, t0, t1 or None while in flight, args], completed in place. Each is kept
    with the step it ends in."""

    def __init__(self, path: str, steps: int, comm, timers, layout, step_of=lambda: None):
        self.path, self.comm, self.timers = path, comm, timers
        self.rank, self.size = comm.rank, comm.size
        if self.rank == 0:
            check_file(path, "trace")     # the library's check (the train CLI checked it at start)
        self.clock = CLOCK
        self._shift = self.clock() - timers.now()     # the timers' instants on this clock (0 unless skewed)
        self.step_of = step_of            # the step in progress (1-based), as the engine numbers it
        self.parts = []                   # the engine's parts whose ``trace`` is this
        self._stats = getattr(comm, "stats", {})
        self._buckets = {b.shard_start: b.index for b in layout.buckets}
        self._names = list(layout.layer_names)
        self._ring = deque(maxlen=steps)  # the events of the last ``steps`` steps, one list each
        self._events = []                 # the events of the step in progress
        self._step = None                 # (t0, timers' busy, timers' wait) once the step has begun
        self._stack = []                  # compute frames: [name, args, t0 or None when paused, resume the one below]
        self._lanes = []                  # comm lanes: in use?
        self._pending = {}                # handle -> its comm record
        self._open = []                   # the comm records in flight, in launch order
        self.written = False
        self.offset, self.round_trip, self.zero = align_clocks(comm, self.clock)
        at_abort(self.dump)

    # ---- steps (the timers' phase changes; the engine's end of step) ----------------------
    def phase(self, phase: Phase) -> None:
        if phase is not Phase.IDLE and self._step is None:
            t = self.timers.now()          # one instant for the span and the timers' totals
            self._step = (t + self._shift, self.timers.busy_total(t), self.timers.wait_total())

    def step_done(self, step: int) -> None:
        """step() returned (``step``: steps taken): the step's span closes and its events join the ring."""
        if self._step is not None:
            t0, busy, wait = self._step
            t = self.timers.now()
            args = {"step": step, "timers_comm_busy_ms": (self.timers.busy_total(t) - busy) * 1e3,
                    "timers_comm_wait_ms": (self.timers.wait_total() - wait) * 1e3}
            self._events.append(("X", STEP, f"step {step}", t0, t + self._shift, args))
            self._step = None
        self._ring.append(self._events)
        self._events = []

    # ---- the compute track: a stack, so that its spans never overlap ---------------------
    def pause(self) -> Optional[float]:
        """The running frame's span ends now (the engine runs); returns now, or None if none ran."""
        top = self._stack[-1] if self._stack else None
        if top is None or top[2] is None:
            return None
        now = self.clock()
        self._events.append(("X", COMPUTE, top[0], top[2], now, top[1]))
        top[2] = None
        return now

    def resume(self) -> None:
        if self._stack and self._stack[-1][2] is None:
            self._stack[-1][2] = self.clock()

    def push(self, name: str, args: dict) -> None:
        paused = self.pause()
        self._stack.append([name, args, paused if paused is not None else self.clock(), paused is not None])

    def pop(self) -> None:
        name, args, t0, resume = self._stack.pop()
        now = self.clock()
        if t0 is not None:
            self._events.append(("X", COMPUTE, name, t0, now, args))
        if resume and self._stack:
            self._stack[-1][2] = now

    def hold(self, layer: int, phase: Phase) -> None:
        """unshard(layer) returns: the layer's compute begins."""
        what = phase.value if phase in (Phase.FORWARD, Phase.BACKWARD) else "compute"
        self.push(f"{what} {self._names[layer]}", {"layer": layer})

    def release(self, layer: int) -> None:
        """reshard(layer) is called: the layer's compute ends (and the running one pauses)."""
        self.pause()
        for i in range(len(self._stack) - 1, -1, -1):
            if self._stack[i][1].get("layer") == layer:
                del self._stack[i]
                return

    def optimizer(self, rows: slice) -> None:
        b = self._buckets.get(rows.start) if rows.start is not None else None
        self.push("optimizer (whole model)" if b is None else f"optimizer b{b}", {"bucket": b})

    def local_part(self, handle) -> None:
        """``handle.wait()``: a collective's local part (a reduce-scatter's sum) as a compute span."""
        b, step = _bucket_step(handle.tag)
        what = "local sum" if handle.op == "reduce_scatter" else f"finish {handle.op}"
        self.push(f"{what} b{b}", {"op": handle.op, "bucket": b, "step": step})
        try:
            handle.wait()
        finally:
            self.pop()

    def background(self, rows: slice, t0: float) -> None:
        """The delayed update's thread did bucket ``rows`` from ``t0`` until now."""
        b = self._buckets.get(rows.start)
        self._events.append(("X", BACKGROUND, f"optimizer b{b}", t0, self.clock(), {"bucket": b}))

    # ---- the wait track -------------------------------------------------------------
    def wait(self, what: str, t0: float, t1: float, handle=None) -> None:
        """An exposed block from ``t0`` to ``t1`` (the timers' clock; timers.exposed)."""
        args = None
        if handle is not None:
            b, step = _bucket_step(handle.tag)
            what, args = f"{what} {handle.op} b{b}", {"op": handle.op, "bucket": b, "step": step}
        self._events.append(("X", WAIT, what, t0 + self._shift, t1 + self._shift, args))

    # ---- the comm lanes -------------------------------------------------------------------
    def _bytes(self) -> int:
        return sum(s.bytes for s in self._stats.values())

    def _comm(self, name: str, t0: float, args: dict) -> list:
        lane = next((i for i, used in enumerate(self._lanes) if not used), len(self._lanes))
        if lane == len(self._lanes):
            self._lanes.append(False)
        self._lanes[lane] = True
        record = ["C", lane, name, t0, None, args]
        self._open.append(record)
        return record

    def _complete(self, record: list, t: float) -> None:
        """Complete at ``t`` (the timers' clock); kept with the step it completes in, so that one in
        flight across a step's start is kept with that step."""
        record[4] = t + self._shift
        self._lanes[record[1]] = False
        self._open.remove(record)
        self._events.append(record)

    def launching(self) -> int:
        """Before a collective is started (InFlight.launch): the bytes sent so far."""
        return self._bytes()

    def launched(self, handle, t: float, sent: int) -> None:
        """``handle`` was started at ``t`` (the timers' clock: the instant they count it in flight from)."""
        b, step = _bucket_step(handle.tag)
        name = handle.op if b is None else f"{handle.op} b{b}"
        self._pending[handle] = self._comm(name, t + self._shift, {"op": handle.op, "bucket": b, "step": step,
                                                                   "bytes": self._bytes() - sent})

    def completed(self, handle, t: float) -> None:
        """A test or a wait saw ``handle`` complete at ``t`` (the timers' clock)."""
        record = self._pending.pop(handle, None)
        if record is not None:
            self._complete(record, t)

    def comm_begin(self, what: str, t: float) -> list:
        """A blocking collective begins at ``t`` (timers.blocking)."""
        return self._comm(what, t + self._shift, {"op": what, "bucket": None, "step": self.step_of(),
                                                  "bytes": self._bytes()})

    def comm_end(self, record: list, t: float) -> None:
        record[5]["bytes"] = self._bytes() - record[5]["bytes"]
        self._complete(record, t)

    # ---- the file -------------------------------------------------------------------
    def events(self, now: Optional[float] = None) -> list:
        """This rank's events as trace-event dicts (``now``: at a crash, spans still open end there)."""
        pid, shift = self.rank, self.offset - self.zero
        us = lambda t: round((t + shift) * 1e6, 3)   # noqa: E731
        out = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": f"rank {pid}"}},
               {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}}]
        spans, tids = [], {STEP, COMPUTE, WAIT}
        for events in list(self._ring) + [self._events, self._open]:
            spans.extend(list(events))
        if now is not None:                          # a crash: what was still open
            if self._step is not None:
                spans.append(("X", STEP, f"step {self.step_of()} (did not end)", self._step[0], now, None))
            if self._stack and self._stack[-1][2] is not None:
                spans.append(("X", COMPUTE, self._stack[-1][0], self._stack[-1][2], now, self._stack[-1][1]))
        for kind, track, name, t0, t1, args in spans:
            if kind == "X":
                tids.add(track)
                e = {"name": name, "cat": CATEGORY[track], "ph": "X", "ts": us(t0), "dur": round(us(t1) - us(t0), 3),
                     "pid": pid, "tid": track}
                if args:
                    e["args"] = args
                out.append(e)
                continue
            tid = LANE0 + track
            tids.add(tid)
            out.append({"name": name, "cat": "comm", "ph": "B", "ts": us(t0), "pid": pid, "tid": tid, "args": args})
            if t1 is not None:                       # not yet complete at a crash: no E
                out.append({"name": name, "cat": "comm", "ph": "E", "ts": us(t1), "pid": pid, "tid": tid})
        for tid in sorted(tids):
            out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                        "args": {"name": TRACKS.get(tid, f"comm {tid - LANE0}")}})
            out.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
        return out

    def _part(self, now=None):
        """(this rank's events as the text inside a JSON array, what otherData says of this rank)."""
        body = json.dumps(self.events(now), separators=(",", ":"))[1:-1]
        return body, {"rank": self.rank, "clock_offset_us": self.offset * 1e6, "round_trip_us": self.round_trip * 1e6}

    def _text(self, parts) -> bytes:
        other = {"zerompi": {"ranks": self.size, "ranks_in_file": [info["rank"] for _, info in parts],
                             "trace_steps": self._ring.maxlen, "clock": [info for _, info in parts],
                             "timestamps": "microseconds of rank 0's clock since the engine started"}}
        body = ",".join(text for text, _ in parts if text)
        return ('{"traceEvents":[' + body + '],"displayTimeUnit":"ms","otherData":' + json.dumps(other)
                + "}\n").encode()

    def write(self) -> Optional[str]:
        """Gather every rank's events and write the file on rank 0 (a collective, timed by the
        watchdog; once). Returns rank 0's one line when the file could not be written, else None."""
        if self.written:
            return None
        self.written = True
        at_abort(self.dump, add=False)
        part = self._part()
        if self.size == 1:
            parts = [part]
        else:
            with watched(self.comm, "trace: gathering every rank's events", self.step_of()):
                parts = self.comm.mpi.gather(part, root=0)
        return save_bytes(self.path, self._text(parts), "trace") if self.rank == 0 else None

    def close(self) -> None:
        """Write the file (unless written) and unhook from the engine; a problem is one line on stderr."""
        problem = self.write()
        for part in self.parts:
            part.trace = None
        if problem:
            sys.stderr.write(f"zerompi: error: {problem}\n")
            sys.stderr.flush()

    def dump(self) -> None:
        """At an abort (errors.at_abort): this rank's events so far, alone, to crash_path."""
        path = crash_path(self.path, self.rank)
        problem = save_bytes(path, self._text([self._part(now=self.clock())]), "trace")
        sys.stderr.write(f"zerompi: rank {self.rank}: {problem or f'the trace so far is in {path}'}\n")
