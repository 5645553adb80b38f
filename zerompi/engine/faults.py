"""Faults inside a step: injected ones (tests) and non-finite gradients (detected).

Injection: the environment variable ZEROMPI_FAULT=KIND@rankR:stepS[:POINT] makes rank R
(the job's rank, MPI.COMM_WORLD's: under tensor parallelism too, not the data-parallel rank)
fail at step S (1-based, as in the progress lines), at POINT:

    backward  (the default) at the first gradients it hands back in step S (the backward of
              the first micro-batch, the other ranks' collectives in flight)
    save      right before the first collective of the checkpoint saved after step S
    metrics   right before the first collective of the final metrics, in a run whose last
              step is S (the metrics follow the last step and its checkpoint)

and KIND says how:

    raise  an exception (the abort hook prints it and ends the job)
    exit   the process exits at once, without cleanup (mpiexec ends the others)
    hang   the rank sleeps forever (the others' collective watchdogs end the job; in a simulated
           world, comm/simulated_world.py, it sleeps in a wait of its own, which its watchdog times)
    nan    every gradient this rank hands back in step S is NaN (backward only)

Detection: :class:`GradientGuard` notes the first bucket where this rank's own gradients
were non-finite (or beyond the storage dtype's range) as they are handed back -- two
reductions (max, min) per gradient -- so that when the all-reduced flag of a step says
"non-finite", the error can name the bucket and the rank where it started. fp16 skips such
a step (the loss scale halves); ``max_skipped_steps`` consecutive skips, or any in fp32,
raise NonFiniteError on every rank, before any parameter is updated.
"""
import os
import re
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence

import numpy as np

from ..errors import ConfigError, NonFiniteError
from ..comm.watchdog import watched
from ..optim import dtypes

FAULT_ENV = "ZEROMPI_FAULT"
KINDS = ("raise", "exit", "hang", "nan")
POINTS = ("backward", "save", "metrics")   # where in step S a fault fires (module docstring)
GRAMMAR = ("KIND@rankR:stepS[:POINT] with KIND one of raise, exit, hang, nan, R a rank, S a step >= 1, "
           "POINT one of backward (the default), save, metrics, and nan only at backward "
           "(e.g. hang@rank1:step3, hang@rank1:step2:save)")
_PATTERN = re.compile(r"([a-z]+)@rank(\d+):step(\d+)(?::([a-z]+))?")
_WHERE = {"backward": "", "save": ", before the checkpoint save's first collective",
          "metrics": ", before the final metrics' first collective"}
EXIT_STATUS = 1   # of the 'exit' fault


class InjectedFault(RuntimeError):
    """The exception of the 'raise' fault."""


@dataclass(frozen=True)
class Fault:
    """One injected fault: ``kind`` on rank ``rank`` at step ``step`` (1-based), at ``point``."""
    kind: str
    rank: int
    step: int
    point: str = "backward"   # one of POINTS

    def __str__(self) -> str:
        at = "" if self.point == "backward" else f":{self.point}"
        return f"{self.kind}@rank{self.rank}:step{self.step}{at}"


def parse_fault(text: str) -> Fault:
    """'hang@rank1:step3' -> Fault('hang', 1, 3); 'hang@rank1:step2:save' -> Fault('hang', 1, 2, 'save').

    ConfigError naming the value and the grammar.
    """
    m = _PATTERN.fullmatch(text.strip())
    point = m and (m.group(4) or "backward")
    if (not m or m.group(1) not in KINDS or int(m.group(3)) < 1 or point not in POINTS
            or (m.group(1) == "nan" and point != "backward")):
        raise ConfigError(f"{FAULT_ENV}={text!r} is not a fault; use {GRAMMAR}")
    return Fault(m.group(1), int(m.group(2)), int(m.group(3)), point)


def fault_from_env(environ=os.environ) -> Optional[Fault]:
    """The fault ZEROMPI_FAULT asks for, or None when it is unset or empty."""
    text = environ.get(FAULT_ENV, "")
    return parse_fault(text) if text.strip() else None


def fire(fault: Fault, stand_ins=None) -> None:
    """Act out a raise / exit / hang fault on this rank (nan is applied by the guard).

    ``stand_ins``: in a simulated world, the engine's Communicator. There no other rank runs to time
    the hang out: the rank sleeps in a wait on its record, as its stand-ins would wait for it in their
    next collective, so its own watchdog ends the job as the others' would in the real one."""
    where = f"rank {fault.rank} at step {fault.step}{_WHERE[fault.point]}"
    if fault.kind == "raise":
        raise InjectedFault(f"injected fault 'raise' on {where} ({FAULT_ENV}={fault})")
    note = {"exit": "exiting at once without cleanup", "hang": "sleeping forever"}[fault.kind]
    if fault.kind == "hang" and stand_ins is not None:
        note = "sleeping until the watchdog ends the job (the stand-in ranks wait for it)"
    sys.stderr.write(f"zerompi: injected fault '{fault.kind}' on {where} ({FAULT_ENV}={fault}): {note}\n")
    sys.stderr.flush()
    sys.stdout.flush()
    if fault.kind == "exit":
        os._exit(EXIT_STATUS)
    op = {"backward": "the next collective", "save": "the checkpoint save's first collective",
          "metrics": "the final metrics' first collective"}[fault.point]
    with (stand_ins.waiting(op, (None, fault.step)) if stand_ins is not None else nullcontext()):
        while True:
            time.sleep(3600)


def range_limit(dtype) -> float:
    """Smallest magnitude that becomes inf when stored in ``dtype`` (round to nearest)."""
    fi = dtypes.finfo(dtype)
    return float(fi.max) + 2.0 ** (fi.maxexp - fi.nmant - 2)   # max + half its ulp: 65520 for fp16


class GradientGuard:
    """Per-engine fault state: the injected fault, where non-finite gradients appeared, skip counts."""

    def __init__(self, rank: int, dtype, max_skipped_steps: int, fault: Optional[Fault] = None, stand_ins=None):
        self.rank = rank               # this process's world rank (a simulated world's: R): the one a fault names
        self.stand_ins = stand_ins     # a simulated world: the engine's Communicator, whose record a hang waits on
        self.tp_rank: Optional[int] = None   # under --tp: this rank's TP rank (named in the non-finite report)
        self.groups: List[tuple] = []  # (what, Communicator) the step's non-finite count is also summed over (TP, PP)
        self.fp16 = np.dtype(dtype) == np.float16          # fp16 skips non-finite steps; fp32 and bf16 stop
        self.name = "fp32" if np.dtype(dtype) == np.float32 else "bf16" if not self.fp16 else "fp16"
        self.limit = range_limit(dtype)                     # |g| >= limit is inf once stored
        self.max_skipped_steps = max_skipped_steps
        self.fault = fault if fault is not None and fault.rank == rank else None   # only this rank's
        self.first_bad_bucket = -1     # this step: lowest bucket with a non-finite local gradient
        self.skipped_in_a_row = 0      # consecutive skipped steps, up to the latest
        self._step = 0                 # the step the two fields above belong to
        self._last_skip = 0            # step number of the latest skip

    # ---- while gradients are handed back ---------------------------------------
    def on_grads(self, step: int, bucket: int, grads: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        """Called with each layer's gradients before they are stored; returns the ones to store."""
        if step != self._step:          # the first gradients of a new step
            self._step, self.first_bad_bucket = step, -1
            if self._due("backward", step) and self.fault.kind != "nan":
                fire(self.fault, self.stand_ins)
        if self._due("backward", step) and self.fault.kind == "nan":
            grads = {n: g * np.float32("nan") for n, g in grads.items()}   # NumPy or CuPy alike
        if self.first_bad_bucket < 0 or bucket < self.first_bad_bucket:
            if any(not (-self.limit < float(g.min()) and float(g.max()) < self.limit) for g in grads.values()):
                self.first_bad_bucket = bucket     # NaN fails both comparisons
        return grads

    def at(self, point: str, step: int) -> None:
        """Act out this rank's injected fault if it is due at ``point`` (save, metrics) after ``step``."""
        if self._due(point, step):
            fire(self.fault, self.stand_ins)

    def injected_nan(self, step: int) -> bool:
        """This rank's injected fault made step ``step``'s gradients NaN (a real run's error, never a stand-in's)."""
        return self._due("backward", step) and self.fault.kind == "nan"

    def _due(self, point: str, step: int) -> bool:
        f = self.fault
        return f is not None and f.point == point and f.step == step

    # ---- when the all-reduced flag says non-finite --------------------------------
    def on_skip(self, step: int, comm, reduced_slices: Sequence[np.ndarray], loss_scale: float, master=None) -> None:
        """A step whose gradients are non-finite somewhere (every rank calls this together).

        Raises NonFiniteError on every rank in fp32, or at ``max_skipped_steps`` skips in a row.
        ``master``: this rank's fp32 master shard, to say whether the parameters themselves were
        already non-finite (an earlier update overflowed) or not.
        """
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if step == self._last_skip + 1 else 1
        self._last_skip = step
        if self.fp16 and self.skipped_in_a_row < self.max_skipped_steps:
            return
        where, bad_params = self.locate(comm, reduced_slices, step, master)
        if bad_params:
            state = (f"the parameters were already non-finite before this step (the master on {bad_params}): an "
                     "earlier update overflowed float32, so lower the learning rate (ZeroConfig.lr, --lr)")
        else:
            state = "every parameter is still finite (this step updated nothing)"
        if not self.fp16:
            raise NonFiniteError(f"non-finite gradients at step {step}: {where}; "
                                 f"{self.name} has no loss scale to lower, "
                                 f"so the job stops; {state} (lower the learning rate: ZeroConfig.lr, --lr; clip: "
                                 "ZeroConfig.clip, --clip; or check the data)")
        raise NonFiniteError(f"{self.skipped_in_a_row} consecutive steps skipped for non-finite fp16 gradients "
                             f"(ZeroConfig.max_skipped_steps, --max-skipped-steps: {self.max_skipped_steps}); the "
                             f"last, step {step}: {where}; the loss scale was {loss_scale:g}; {state} (lower "
                             "ZeroConfig.init_loss_scale / --loss-scale or the learning rate, or check the data)")

    def locate(self, comm, reduced_slices: Sequence[np.ndarray], step: int, master=None):
        """('first in bucket B on rank R', the ranks whose master is non-finite, '' for none): one all-gather
        over ``comm`` and one over each of ``groups`` (the error path only: every rank is here). Ranks are
        world ranks; under --tp with their TP rank; under --pp the model chunk is named (every engine of the
        rank is looked at: ``siblings``)."""
        mine = [(chunk, g.first_bad_bucket if g._step == step else -1,
                 next((b for b, x in enumerate(slices) if not _all_finite(x)), -1),
                 m is None or _all_finite(m)) for chunk, g, slices, m in self.siblings(reduced_slices, master)]
        table: List[tuple] = [(self.rank, self.tp_rank, mine)]
        for what, group in [("the data-parallel group", comm)] + list(self.groups):
            mpi = getattr(group, "mpi", group)
            with watched(group, f"non-finite gradient report: all-gather over {what}", step):
                table = [row for part in mpi.allgather(table) for row in part]
        table = sorted(set((r, t, tuple(parts)) for r, t, parts in table))   # a simulated world's mirrors: once
        bad_params = sorted({r for r, _, parts in table if not all(ok for *_, ok in parts)})
        params = (f"rank{'s' if len(bad_params) > 1 else ''} {', '.join(map(str, bad_params))}"
                  if bad_params else "")
        tp = {r: t for r, t, _ in table}
        name = lambda r: f"rank {r}" + (f" (TP rank {tp[r]})" if tp[r] is not None else "")    # noqa: E731
        chunk = lambda c: f" of model chunk {c}" if c is not None else ""                     # noqa: E731
        bad = sorted((c if c is not None else -1, b, r) for r, _, parts in table for c, b, _, _ in parts if b >= 0)
        if bad:
            c, b, r = bad[0]
            ranks = sorted({rr for _, _, rr in bad})
            also = f" (non-finite gradients on ranks {ranks})" if len(ranks) > 1 else ""
            spread = ""
            if self.tp_rank is not None and len({tp[rr] for rr in ranks}) > 1:
                spread = ("; the TP ranks of a group sum their activations and gradients in the forward and backward, "
                          "so a non-finite value on one reaches the others: it may have started on any of them")
            return f"first in bucket {b}{chunk(c if c >= 0 else None)} on {name(r)}{also}{spread}", params
        sums = sorted((c if c is not None else -1, b, r) for r, _, parts in table for c, _, b, _ in parts if b >= 0)
        if sums:
            c, b, r = sums[0]
            return (f"first in bucket {b}{chunk(c if c >= 0 else None)}, in the slice {name(r)} reduces: every rank's "
                    "own gradients were finite, their sum over ranks overflowed the storage dtype"), params
        return ("every rank's own gradients and every reduced slice were finite; their sum of squares, the gradient "
                "norm's, overflowed"), params

    def siblings(self, reduced_slices, master):
        """[(model chunk or None, guard, its reduced slices, its master)] of every engine of this rank: this one
        alone, unless a pipeline set ``pipeline_engines`` (its chunks' engines, which decide one step)."""
        engines = getattr(self, "pipeline_engines", None)
        if not engines:
            return [(None, self, reduced_slices, master)]
        return [(c, e.guard, e.reducer.reduced_slices(), e.optimizer.master) for c, e in engines.items()]


def _all_finite(arr) -> bool:
    """True when every element is finite; NumPy or CuPy (np.isfinite dispatches, no host copy)."""
    return bool(np.isfinite(arr).all()) if arr.size else True
