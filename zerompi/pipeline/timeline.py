"""A schedule run on per-action costs, without MPI: when each action starts and ends on its rank,
the bubble, and the activations each rank holds.

Each rank runs its actions in order. A SEND or RECV only posts a message (no time); a message's
data is there ``latency`` seconds after both its SEND and its RECV are posted; an F or B waits for
the data it needs (from another rank's SEND, or from this rank's own earlier action when the
neighbouring chunk lives here too). Compute actions take ``cost(action)`` seconds: by default F
costs ``f``, W costs ``w``, and B costs ``b`` when the schedule has W actions, ``b + w`` when B does
both (a full backward). All ranks start together at 0.

- bubble of rank r = 1 - (its compute seconds) / (the whole schedule's length, the last end);
  ``bubble_fraction`` is their mean (1F1B with F = 1, B = 2: (P - 1) / (m + P - 1));
- in flight on rank r: micro-batches whose F has started and whose B (W when split) has not ended,
  counted per chunk; ``peak_activations`` divides by the chunks per rank: micro-batches of a whole
  stage's activations (1F1B: P on rank 0; GPipe: m).

A schedule whose ranks all wait with actions left is a deadlock (:class:`Deadlock` names the waits).
"""
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from .actions import COMPUTE, Action, Schedule, ScheduleError


class Deadlock(ScheduleError):
    """Every rank with actions left waits for a message or a result that nothing will produce."""


@dataclass
class Simulation:
    """The result of :func:`run` (seconds in the costs' unit)."""
    spans: List[List[Tuple[Action, float, float]]]     # per rank: (compute action, start, end)
    makespan: float                                   # when the last action ends
    busy: List[float]                                 # per rank: seconds of compute
    peak_in_flight: List[int]                         # per rank: chunk micro-batches held at once, at most
    chunks_per_rank: List[int]
    bubble: List[float] = field(default_factory=list)  # per rank

    def __post_init__(self):
        self.bubble = [1.0 - b / self.makespan if self.makespan > 0 else 0.0 for b in self.busy]

    @property
    def bubble_fraction(self) -> float:
        return sum(self.bubble) / len(self.bubble)

    @property
    def peak_activations(self) -> float:
        """The most micro-batches of one stage's activations any rank holds at once."""
        return max(p / v for p, v in zip(self.peak_in_flight, self.chunks_per_rank))

    def as_dict(self) -> dict:
        return {"bubble_fraction": self.bubble_fraction, "bubble": self.bubble, "makespan": self.makespan,
                "busy": self.busy, "peak_in_flight": self.peak_in_flight, "peak_activations": self.peak_activations}


def unit_costs(schedule: Schedule, f: float = 1.0, b: float = 1.0, w: float = 1.0) -> Callable[[Action], float]:
    """F costs f, W costs w, B costs b (split schedules) or b + w (B is the full backward)."""
    full = not schedule.split_backward
    table = {"F": f, "B": b + w if full else b, "W": w}
    return lambda a: table.get(a.kind, 0.0)


def run(schedule: Schedule, cost: Optional[Callable[[Action], float]] = None, latency: float = 0.0) -> Simulation:
    """Simulate ``schedule`` (its actions are assumed well formed: validate.check runs this after its
    other checks); Deadlock when it cannot finish."""
    cost = cost or unit_costs(schedule)
    acts, where = schedule.actions, schedule.placement()
    p, chunks = schedule.ranks, schedule.chunks
    ptr, clock = [0] * p, [0.0] * p
    posted: Dict[Tuple[str, int, int], float] = {}    # (SEND_x or RECV_x, mb, chunk) -> when posted
    finished: Dict[Tuple[str, int, int], float] = {}  # (F/B/W, mb, chunk) -> when it ended
    spans: List[List[Tuple[Action, float, float]]] = [[] for _ in range(p)]
    held, peak, busy = [0] * p, [0] * p, [0.0] * p

    def ready(r: int, a: Action) -> Optional[float]:
        """When the data ``a`` needs is there (None: not yet known)."""
        if a.kind == "F" and a.chunk > 0:
            return _arrival(r, "F", a.mb, a.chunk - 1, a.chunk, where, posted, finished, latency)
        if a.kind == "B" and a.chunk < chunks - 1:
            return _arrival(r, "B", a.mb, a.chunk + 1, a.chunk, where, posted, finished, latency)
        return 0.0

    moved = True
    while moved:
        moved = False
        for r in range(p):
            while ptr[r] < len(acts[r]):
                a = acts[r][ptr[r]]
                t = ready(r, a)
                if t is None:
                    break
                start = max(clock[r], t)
                if a.kind in COMPUTE:
                    end = start + cost(a)
                    spans[r].append((a, start, end))
                    finished[(a.kind, a.mb, a.chunk)] = end
                    busy[r] += end - start
                    if a.kind == "F":          # its activations are kept from here ...
                        held[r] += 1
                        peak[r] = max(peak[r], held[r])
                    elif a.kind == "W" or not schedule.split_backward:   # ... to its last backward
                        held[r] -= 1
                    clock[r] = end
                else:
                    posted[(a.kind, a.mb, a.chunk)] = start
                    clock[r] = start
                ptr[r] += 1
                moved = True
    left = [r for r in range(p) if ptr[r] < len(acts[r])]
    if left:
        raise Deadlock("deadlock: " + "; ".join(f"rank {r} waits at {acts[r][ptr[r]]} (action {ptr[r]})"
                                                 for r in left)
                       + ": each waits for data that another waiting rank has not sent")
    makespan = max((end for s in spans for _, _, end in s), default=0.0)
    return Simulation(spans, makespan, busy, peak, [max(1, len(schedule.chunks_of(r))) for r in range(p)])


def _arrival(r, direction, mb, src_chunk, dst_chunk, where, posted, finished, latency) -> Optional[float]:
    """When ``dst_chunk`` on rank r has the data of ``src_chunk`` (F: its output; B: its input gradient)."""
    if where[src_chunk] == r:                       # the neighbour is local: its own action's end
        return finished.get((direction, mb, src_chunk))
    sent = posted.get(("SEND_" + direction, mb, src_chunk))
    received = posted.get(("RECV_" + direction, mb, dst_chunk))
    if sent is None or received is None:
        return None
    return max(sent, received) + latency


def in_flight(schedule: Schedule, rank: int) -> Dict[int, int]:
    """{chunk: the most micro-batches of it held at once on ``rank``}: from its F to its last backward (W when
    the backward is split), counted in the rank's own action order (no costs needed)."""
    held: Dict[int, int] = {}
    peak: Dict[int, int] = {}
    last = "W" if schedule.split_backward else "B"
    for a in schedule.actions[rank]:
        if a.kind == "F":
            held[a.chunk] = held.get(a.chunk, 0) + 1
            peak[a.chunk] = max(peak.get(a.chunk, 0), held[a.chunk])
        elif a.kind == last:
            held[a.chunk] -= 1
    return peak
