"""The optimizer step in two halves, so that several engines can decide one step together.

``ZeroEngine.step(lr)`` is ``finish(engine, begin(engine, lr))``:

- :func:`begin` completes the micro-batches' reductions and returns a :class:`PendingStep`
  holding this engine's gradient statistics (the sum of squares of its reduced gradient, and a
  count of the ranks that saw a non-finite value), summed in rank order over its data-parallel
  group (one shard group) and its tensor-parallel group: the same bits on every rank of the
  engine. What every rank must agree on (lr, step, gathers: engine/contract.py) is checked here.
- :func:`finish` decides from the totals (by default the engine's own) whether the step is skipped
  (a non-finite value), the gradient norm and the clip coefficient, then updates the shard and
  publishes the parameters.

A caller that runs several engines as one model (the pipeline: one engine per stage and chunk,
zerompi/pipeline/) calls ``begin_step`` on each, sums their totals over the whole mesh in one
fixed order and passes that sum to each ``finish_step``: every engine then applies, or skips, the
same step with the same clip coefficient and loss scale.
"""
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ..checkpoint import collective as checkpoint
from ..comm.blocks import sum_table
from ..comm.simulated_world import simulated
from ..errors import ConfigError, UsageError
from . import contract
from .phase import Phase

F32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did."""
    step: int            # optimizer steps applied so far (skipped steps do not count)
    skipped: bool        # True when a non-finite gradient made every rank skip the update
    grad_norm: float     # global L2 norm of the true (unscaled, unclipped) gradient; inf/nan if skipped
    clip_coef: float     # factor applied to the gradient by clipping (1.0 = not clipped)
    loss_scale: float    # the loss scale used for this step's gradients


@dataclass(frozen=True)
class PendingStep:
    """A step begun (gradients reduced, totals known) and not yet finished."""
    lr: float            # the learning rate of this step
    sumsq: float         # sum of squares of this engine's whole gradient (times loss_scale squared)
    nonfinite: float     # ranks of this engine (its DP x TP groups) that saw a non-finite gradient value
    number: int          # the engine's step() call this is (1-based, skipped steps included)


def begin(engine, lr: Optional[float]) -> PendingStep:
    """The first half of the step: reductions complete, this engine's totals (a collective over its ranks)."""
    engine._check_open()
    if engine._pending is not None:
        raise UsageError("begin_step() twice without finish_step(); finish the step begun first")
    if lr is not None and not (isinstance(lr, (int, float, np.floating)) and 0 < lr <= F32_MAX):
        raise ConfigError(f"step(lr={lr!r}) is not allowed; use a number > 0 and <= {F32_MAX:.4g} "
                          "(the update runs in float32)")
    engine.reducer.check_complete()
    if engine.gatherer.held:
        held = [i for i, n in enumerate(engine.gatherer.holds) if n]
        raise UsageError(f"step() while layers {held} are unsharded (unshard without reshard); leave every "
                         "'with engine.unsharded(i)' block (or call reshard(i)) before step()")
    engine._enter(Phase.OPTIMIZER)
    engine.synchronize()
    checkpoint.poll(engine)     # a background save: published, or a rank's write failure raised on every rank
    if engine.config.stage == 3:
        engine.gatherer.free()
    engine.reducer.collect()
    if engine.replica is not None:   # several shard groups: one all-reduce across them
        with engine.timers.blocking("all_reduce across shard groups"):
            engine.reducer.reduce_replicas()
    lay = engine.layout
    sumsq, nonfinite = engine.tp.stats(engine.reducer, lay, engine.slot) if engine.tp else engine.reducer.stats()
    lr = engine.config.lr if lr is None else float(lr)
    number = engine.steps_taken + 1
    with engine.timers.blocking("gather_scalars"):   # + what every rank must agree on (engine/contract.py)
        table = engine.comm.gather_scalars([sumsq, float(nonfinite)]
                                           + contract.step_columns(lr, number, engine.gatherer.log))
    contract.check_step(engine.comm, table, engine.gatherer.log)
    engine.gatherer.log.reset()
    total = sum_table(table[:engine.topology.shard_size, :2])   # one shard group: the others hold copies
    total = engine.tp.combine(total, lr, number) if engine.tp else total   # + other TP ranks' pieces
    engine._pending = PendingStep(lr, float(total[0]), float(total[1]), number)
    return engine._pending


def finish(engine, pending: PendingStep, totals: Optional[Sequence[float]] = None) -> StepResult:
    """The second half: skip or update by ``totals`` ((sum of squares, non-finite count); None: the
    pending step's own), then publish. Every rank of the engine must pass the same totals."""
    if pending is None or pending is not engine._pending:
        raise UsageError("finish_step() needs the PendingStep this engine's begin_step() returned, once")
    engine._pending = None
    sumsq, nonfinite = (pending.sumsq, pending.nonfinite) if totals is None else (float(totals[0]), float(totals[1]))
    lay, grads = engine.layout, engine.reducer.reduced_slices()
    scale = engine.scaler.scale
    overflow = nonfinite > 0 or not math.isfinite(sumsq)
    if (overflow and simulated(engine.comm)
            and not engine.guard.injected_nan(engine.steps_taken + 1)):
        sumsq, overflow = _stand_in_overflow(engine, grads), False
    engine.steps_taken += 1
    if overflow:   # fp32, or too many fp16 skips in a row: NonFiniteError on every rank, nothing updated
        engine.in_backward.take_back()     # updates begun in the backward (engine/in_backward.py) set back first
        engine.guard.on_skip(engine.steps_taken, engine.comm, grads, scale, engine.optimizer.master)
        engine.scaler.update(True)
        engine._end_step()
        return StepResult(engine.step_count, True, float("nan"), 1.0, scale)
    norm = math.sqrt(sumsq) / scale
    clip = engine.config.clip
    coef = clip / (norm + 1e-6) if clip > 0 and norm > clip else 1.0
    engine.step_count += 1
    _update(engine, lay, grads, engine.optimizer.scalars(pending.lr, engine.step_count, coef / scale))
    engine.in_backward.after_step(pending.lr, coef)
    engine.gatherer.parameters_changed()
    engine.scaler.update(False)
    engine._end_step()
    return StepResult(engine.step_count, False, norm, coef, scale)


def _stand_in_overflow(engine, grads) -> float:
    """A simulated rank (comm/simulated_world.py) whose gradients are not finite: the values are its stand-ins' mirror
    of it (an all-gather tiles its own shard), no real run's, so the step is not skipped -- the real job applies
    its steps, gathers and updates, and the simulated rank must send and hold what it does. The step is applied
    with zero gradients (the parameters stay finite); the steps so applied are counted. Returns the new sum of
    squares, 0."""
    for g in grads:
        g.fill(0)
    engine.stand_in_overflows += 1
    return 0.0


def _update(engine, lay, grads, s) -> None:
    """AdamW on the shard with scalars ``s``, and the stored parameters published (stages 1/2 behind it):
    the delayed update (after its warm-up) starts update k behind the next step; stage 0 updates the
    whole model; updates begun in the backward with these very scalars are kept (engine/in_backward.py);
    else bucket by bucket."""
    stage, opt = engine.config.stage, engine.optimizer
    if stage == 0:
        with engine.timers.blocking("all_gather (stage 0)"):
            engine.reducer.all_gather(engine.steps_taken)
    publish = stage in (1, 2)
    if opt.delayed and engine.step_count > engine.config.offload_delayed_warmup:
        # publish update k - 1 (its master), start update k behind the next step
        opt.wait()
        if opt.unpublished:
            engine.publish_params()
        opt.launch([(bk.shard_slice, grads[bk.index], None) for bk in lay.buckets], s)
        return
    if stage == 0:
        opt.update(slice(None), engine.reducer.grads, engine.gatherer.params, s)
        return
    if engine.in_backward.settle(s):
        for bk in lay.buckets if publish else ():
            engine.gatherer.start(bk.index, engine.steps_taken + 1)
        engine.inflight.poll()
    else:
        def after(b):           # stages 1/2 publish bucket b behind the next buckets' update
            if publish:
                engine.gatherer.start(b, engine.steps_taken + 1)
            engine.inflight.poll()
        opt.step([(bk.shard_slice, grads[bk.index], engine.gatherer.param_out(bk.index))
                  for bk in lay.buckets], s, after)       # + the stored copy
    if not engine.config.lazy_publish:   # views taken before step() read new values, never a mix
        engine.gatherer.finish_all()
