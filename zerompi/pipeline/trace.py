"""The pipeline's timeline: every rank's schedule as a Chrome trace-event file (Perfetto, chrome://tracing).

``--trace FILE`` with ``--pp``: the last steps' actions of every rank (one process per rank, named by its
stage, data-parallel and TP coordinates), in three tracks:

  schedule      F / B / W of micro-batch mb on chunk c (``F3 c1``), from when its data was there to its end
  idle          the bubble: a wait for a message's data before an action, the gaps between actions, and the
                time before the first action and after the last one of the pipeline group's step
  messages      each send and receive, from its post to the test or wait that saw it done (args: bytes, peer)

Times are microseconds on a clock aligned over the mesh (engine/trace.py's ping-pong), from the first
step kept. The figure of docs/pipeline.md is drawn from this file (scripts/plot_pipeline.py).
"""
import json
from typing import List, Optional

from ..checkpoint.outputs import save_bytes
from ..comm.watchdog import watched

SCHEDULE, IDLE, MESSAGES = 1, 2, 3
TRACKS = {SCHEDULE: "schedule", IDLE: "idle (bubble)", MESSAGES: "messages"}


def rank_events(steps, messages) -> dict:
    """This rank's kept steps: [[(action text, chunk, mb, start, ready, end), ...] per step] and its messages."""
    return {"steps": [[(f"{a.kind}{a.mb} c{a.chunk}", a.kind, a.chunk, a.mb, t0, ready, t1)
                       for a, t0, ready, t1 in step]
                      for step in steps],
            "messages": [list(step) for step in messages]}


def events_of(rank: int, name: str, mine: dict, bounds, zero: float) -> List[dict]:
    """Trace events of one rank; ``bounds``: per step (the pipeline group's first start, last end)."""
    us = lambda t: round((t - zero) * 1e6, 3)   # noqa: E731
    out = [{"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": name}},
           {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}}]
    for tid, label in TRACKS.items():
        out.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": label}})
    span = lambda tid, what, t0, t1, args=None: out.append(   # noqa: E731
        {"name": what, "cat": TRACKS[tid], "ph": "X", "ts": us(t0), "dur": round(us(t1) - us(t0), 3), "pid": rank,
         "tid": tid, **({"args": args} if args else {})})
    for step, (first, last) in zip(mine["steps"], bounds):
        prev = first
        for text, kind, chunk, mb, t0, ready, t1 in step:
            if t0 > prev:
                span(IDLE, "idle", prev, t0)
            if ready > t0:
                span(IDLE, f"wait for the data of {text}", t0, ready)
            span(SCHEDULE, text, ready, t1, {"kind": kind, "chunk": chunk, "micro_batch": mb})
            prev = max(prev, t1)
        if last > prev:
            span(IDLE, "idle", prev, last)
    for step in mine["messages"]:
        for kind, send, peer, nbytes, t0, t1 in step:
            span(MESSAGES, f"{'send' if send else 'receive'} {kind} {'to' if send else 'from'} stage {peer}", t0, t1,
                 {"bytes": nbytes, "peer_stage": peer})
    return out


def write_trace(path: str, job, steps, messages) -> Optional[str]:
    """Gather every rank's events; rank 0 writes ``path`` (a collective). Rank 0's one line when it failed."""
    comm, mesh = job.comm, job.mesh
    with watched(comm, "pipeline trace: gathering every rank's events"):
        everyone = comm.mpi.gather(rank_events(steps, messages), root=0)
    if comm.rank != 0:
        return None
    starts = [t[4] for e in everyone for step in e["steps"] for t in step]
    zero = min(starts) if starts else 0.0
    groups = {}
    for r in range(comm.size):
        c = mesh.coords(r)
        groups.setdefault((c["dp"], c["tp"]), []).append(r)
    events = []
    for r, mine in enumerate(everyone):
        c = mesh.coords(r)
        group = groups[(c["dp"], c["tp"])]
        bounds = []
        for k in range(len(mine["steps"])):
            ts = [t for g in group if k < len(everyone[g]["steps"]) for t in everyone[g]["steps"][k]]
            bounds.append((min(t[4] for t in ts), max(t[6] for t in ts)) if ts else (0.0, 0.0))
        events += events_of(r, f"rank {r} (stage {c['pp']}, dp {c['dp']}, tp {c['tp']})", mine, bounds, zero)
    other = {"zerompi": {"pipeline": {"schedule": job.schedule.name, "pp": mesh.pp, "dp": mesh.dp, "tp": mesh.tp,
                                      "chunks": job.schedule.chunks, "micro_batches": job.schedule.micro_batches},
                         "ranks": comm.size,
                         "timestamps": "microseconds of an aligned clock since the first kept step"}}
    text = json.dumps({"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}, separators=(",", ":"))
    return save_bytes(path, (text + "\n").encode(), "trace")
