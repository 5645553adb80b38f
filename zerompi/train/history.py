"""The step loop's record, kept in bounded memory (docs/failures.md).

The per-step lists keep the last HISTORY_STEPS steps (the medians of the metrics are over those), the
counts and totals every step's in a few numbers; ``losses[i]`` is the loss of step ``first_kept + i``. A
steady step's figures leave out the run's first step (stage 3 also gathers for the step after it); a run
of one step has none.
"""
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, Mapping, Optional

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
    stats: Optional[Mapping] = None              # comm.stats (op -> OpStats), read after the first step
    first_ops: Optional[Dict[str, int]] = None   # bytes per op the run's first step sent (None: not yet run)

    def __post_init__(self):
        self.cap = HISTORY_STEPS if self.cap is None else self.cap
        self.losses, self.times, self.parts, self.comm_bytes, self.level_bytes = (
            deque(maxlen=self.cap) for _ in range(5))
        self.val_losses = deque(maxlen=VAL_HISTORY)
        self.groups = {}

    def record_group(self, name: str, sent: int, seconds: float) -> None:
        """The bytes and seconds of a model-parallel group's collectives (TP, SP) in one step."""
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
        if self.steps_run == 1 and self.stats is not None:
            self.first_ops = {op: st.bytes - self.base_bytes.get(op, 0) for op, st in self.stats.items()}

    @property
    def first_kept(self) -> int:
        """The step whose loss is ``losses[0]``."""
        return self.first_step + self.steps_run - len(self.losses)

    # ---- a steady step: every step but the run's first -----------------------------------------
    def steady(self, series) -> list:
        """The values of ``series`` (one per kept step, as ``losses``) of the kept steps after the run's first."""
        values = list(series)
        return values[1:] if self.first_kept == self.first_step else values

    def steady_median(self, series) -> Optional[int]:
        """The median of ``series`` over the steady steps; None when only the first step ran."""
        values = self.steady(series)
        return int(statistics.median(values)) if values else None

    def first_value(self, series) -> Optional[int]:
        """The run's first step's value of ``series`` (None once it is no longer kept)."""
        values = list(series)
        return int(values[0]) if values and self.first_kept == self.first_step else None

    def steady_per_op(self, exclude=()) -> Optional[Dict[str, float]]:
        """Bytes per op of a steady step: the mean over the steps after the first, base_bytes aside; None: one ran."""
        if self.stats is None or self.first_ops is None or self.steps_run < 2:
            return None
        return {op: (st.bytes - self.base_bytes.get(op, 0) - self.first_ops.get(op, 0)) / (self.steps_run - 1)
                for op, st in sorted(self.stats.items()) if op not in exclude}

    def first_per_op(self, exclude=()) -> Optional[Dict[str, int]]:
        """Bytes per op the run's first step sent (``stats`` given; None before it)."""
        if self.first_ops is None:
            return None
        return {op: b for op, b in sorted(self.first_ops.items()) if op not in exclude}

    def traffic_figures(self) -> list:
        """[a steady step's bytes, of them inside a node, across nodes, unquantized; the first step's bytes]: the
        medians of the kept steps after the first, -1 for a figure not measured (the form the final metrics'
        all-reduce of maxima carries)."""
        series = [self.comm_bytes] + list(zip(*self.level_bytes or [(0, 0, 0)]))
        figures = [self.steady_median(v) for v in series] + [self.first_value(self.comm_bytes)]
        return [-1 if v is None else v for v in figures]
