"""The step loop's record, kept in bounded memory.

Per step the train CLI keeps its loss, its wall time and the engine's timers (about 430
bytes a step in Python objects), for the metrics. A run of a million steps would hold half
a gigabyte per rank, so the rule is (docs/failures.md): the per-step lists keep the last
HISTORY_STEPS steps; the medians of the metrics (step_time_s, time_breakdown_s, the traffic
of a step) are over those; the counts and totals (steps_run, tokens_per_s) are over every
step, in a few numbers. ``losses[i]`` is the loss of step ``first_kept + i``.
A run of at most HISTORY_STEPS steps keeps everything, as before.
"""
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, Optional

HISTORY_STEPS = 10_000     # steps whose loss, time and timers the metrics list; older ones are dropped
VAL_HISTORY = 1_000        # held-out losses kept (one every --eval-every steps)


@dataclass
class StepLog:
    """What the step loop records: the last HISTORY_STEPS steps' numbers, and totals of all."""

    first_step: int                              # the first step run (> 0 when resumed)
    base_bytes: Dict[str, int]                   # comm.stats bytes per op not sent by the steps (initial gather, eval)
    cap: Optional[int] = None                    # steps kept; None: HISTORY_STEPS (read when the log is made)
    losses: Deque[float] = field(default=None)   # the step's loss, mean over ranks
    times: Deque[float] = field(default=None)    # this rank's wall seconds of the step
    parts: Deque[dict] = field(default=None)     # the engine's timers of the step (engine/timers.py)
    val_losses: Deque[list] = field(default=None)   # [step, held-out loss] pairs (GPT)
    val_rows: Optional[int] = None               # held-out rows the latest evaluation covered, over every rank
    steps_run: int = 0                           # steps recorded, all of them
    total_time: float = 0.0                      # their wall seconds, summed
    comm_bytes: Deque[int] = field(default=None)   # bytes this rank sent in the step (sum_scalars aside)
    level_bytes: Deque[tuple] = field(default=None)   # the same as (inside its node, across nodes, unquantized)
    groups: Dict[str, Deque[tuple]] = field(default=None)   # {"tp", "sp": (bytes, seconds) of the step's model groups}

    def __post_init__(self):
        self.cap = HISTORY_STEPS if self.cap is None else self.cap
        self.losses, self.times, self.parts, self.comm_bytes, self.level_bytes = (
            deque(maxlen=self.cap) for _ in range(5))
        self.val_losses = deque(maxlen=VAL_HISTORY)
        self.groups = {}

    def record_group(self, name: str, sent: int, seconds: float) -> None:
        """The bytes and seconds of a model-parallel group's collectives (TP all-reduce, SP all-to-all) in
        one step's forward and backward."""
        self.groups.setdefault(name, deque(maxlen=self.cap)).append((sent, seconds))

    def group_series(self, name: str):
        """([bytes of each kept step], [seconds of each]) of group ``name`` (empty lists: none recorded)."""
        series = list(self.groups.get(name, ()))
        return [b for b, _ in series], [s for _, s in series]

    def record(self, loss: float, seconds: float, comm_bytes: int, parts: dict, levels=(0, 0)) -> None:
        """One step's numbers (the oldest kept step is dropped once ``cap`` are kept)."""
        self.losses.append(loss)
        self.times.append(seconds)
        self.parts.append(parts)
        self.comm_bytes.append(comm_bytes)
        self.level_bytes.append(tuple(levels))
        self.steps_run += 1
        self.total_time += seconds

    @property
    def first_kept(self) -> int:
        """The step whose loss is ``losses[0]``."""
        return self.first_step + self.steps_run - len(self.losses)
