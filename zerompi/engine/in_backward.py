"""The optimizer in the backward: a bucket's update starts as soon as its gradient shard is final.

With the optimizer's rows in a file (``offload_optimizer="nvme"``), the step's cost is the rows'
I/O: read 12 bytes per shard element, write them back. Here that I/O runs beside the backward:
when the last reduction of bucket b completes (GradientReducer.on_final: stages 1-3 reduce-
scatter into the shard, so the shard is final then), a thread of its own updates bucket b --
its rows read ahead by offload/stream.py's pipeline, its new rows written behind -- while the
backward goes on with the next buckets. The step then has only the last bucket's update left.

The update needs what only step() knows: whether the step is skipped (a non-finite gradient
somewhere), the clip factor (the global norm) and the learning rate. The updates in the
backward run with a guess -- not skipped, no clipping, the last step's learning rate -- and
write the rows into the file's spare generation; step() compares the guess with the real
scalars. Equal (the common case: bit for bit the same update): the rows are committed. A
skipped step: nothing is committed, and the stored parameters the updates wrote are set back
from the master. Another clip factor or learning rate: the update runs again after the norm,
from the rows as they were (the spare is overwritten), exactly as without this module. So the
result is the same bits whatever happens, and a wrong guess costs one more pass of I/O.

When a guess would be wrong again -- the last step clipped, or changed the learning rate (a
schedule) -- the updates wait for the norm: the first buckets' rows are read ahead during the
forward and backward (the buffer sets), the rest stream after the norm. Not used where the
shard is not final after its reduce-scatter (shard groups: an all-reduce across groups
follows in step()), without overlap, with the delayed update, or with one generation of rows
(an offload folder without room for the spare).
"""
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Optional

from ..optim.reference import AdamWScalars


class UpdateInBackward:
    """The updates started in the backward of the step under way, and the guess they ran with."""

    def __init__(self, engine):
        c, rows = engine.config, engine.optimizer.rows
        self.engine = engine
        self.possible = (c.offload_optimizer == "nvme" and getattr(rows, "spare", False) and c.stage > 0
                         and not c.offload_delayed_update and engine.replica is None and c.overlap)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerompi-update") if self.possible else None
        self.guess: Optional[AdamWScalars] = None   # the scalars of this step's early updates; None: none yet
        self.jobs: Dict[int, object] = {}           # bucket -> its update's future
        self.last_lr = c.lr                         # the learning rate the next guess takes
        self.steady = True                          # the last step neither clipped nor changed the lr
        self.early_steps = 0                        # steps whose updates ran in the backward and were kept
        self.taken_back = 0                         # steps whose early updates were not (skipped, or guessed wrong)
        if self.possible:
            engine.reducer.on_final = self.ready
        engine.optimizer.plan_next(self.order(), 1)  # a file's rows: the first step's read ahead

    @property
    def armed(self) -> bool:
        """Whether this step's updates start in the backward."""
        return self.possible and self.steady

    def ready(self, b: int) -> None:
        """Bucket b's gradient shard is final: start its update (the reducer calls this)."""
        if not self.armed:
            return
        e = self.engine
        if self.guess is None:     # not skipped, not clipped, the last step's lr: 1 / loss scale undoes the scaling
            self.guess = e.optimizer.scalars(self.last_lr, e.step_count + 1, 1.0 / e.scaler.scale)
        sl = e.layout.buckets[b].shard_slice
        self.jobs[b] = self._pool.submit(e.optimizer.update, sl, e.reducer.final_slice(b), e.gatherer.param_out(b),
                                         self.guess, True)

    def _wait(self) -> None:
        jobs, self.jobs = self.jobs, {}
        for fut in jobs.values():
            fut.result()               # an OffloadError from the thread is raised here

    def settle(self, s: AdamWScalars) -> bool:
        """step() knows the update's scalars ``s``: True when the early updates were exactly that update
        (their rows committed); False when there were none, or they are taken back (the caller then runs
        the update, which rewrites every row and stored parameter)."""
        if self.guess is None:
            return False
        every = len(self.jobs) == len(self.engine.layout.buckets)    # each bucket's update ran once
        self._wait()
        guess, self.guess = self.guess, None
        if every and tuple(guess) == tuple(s):
            self.engine.optimizer.rows.commit([bk.shard_slice for bk in self.engine.layout.buckets])
            self.early_steps += 1
            return True
        self.taken_back += 1
        return False

    def take_back(self) -> None:
        """A skipped step (every rank calls this together): the early updates' rows are never committed,
        and the stored parameters they wrote are set back from the master (qwZ: gathered again, as a
        step's publish made them)."""
        if self.guess is None:
            return
        self._wait()
        self.guess = None
        self.taken_back += 1
        e = self.engine
        e.publish_params(all_gather=e.gatherer.wire_quant is not None)

    def after_step(self, lr: float, coef: float) -> None:
        """Whether the next guess may hold: this step did not clip and kept the learning rate."""
        self.steady = coef == 1.0 and lr == self.last_lr
        self.last_lr = lr

    def order(self):
        """The bucket slices of the next step's update in the order it will run them."""
        buckets = self.engine.layout.buckets
        return [bk.shard_slice for bk in (reversed(buckets) if self.armed else buckets)]

    def stats(self) -> Dict[str, float]:
        """What offload did on this rank: the steps whose updates ran in the backward (kept, taken back)
        and the seconds spent hashing the offload files' records (offload/files.py)."""
        e = self.engine
        files = [getattr(e.optimizer.rows, "file", None), getattr(e.gatherer.param_file, "file", None)]
        return {"updates_in_backward": self.early_steps, "taken_back": self.taken_back,
                "check_seconds": sum(f.check_seconds for f in files if f is not None)}

    def close(self) -> None:
        if self._pool is not None:
            self._wait()
            self._pool.shutdown()
