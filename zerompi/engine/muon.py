"""ShardedMuon: Muon for the 2-D matrices ``muon_params`` names, AdamW for every other row of the shard.
(A stack ``muon_stacked`` names, an MoE's experts (E, rows, cols), is E matrices: engine/matrix_owners.py.)

The state is flat and slice-aligned like AdamW's, so checkpoints save, load and reshard it by name
with no change: rows ``master``, ``momentum`` (Muon's, on the matrices' rows) and ``exp_avg``,
``exp_avg_sq`` (AdamW's, on the others'; zero on the matrices'). A step (optim/muon.py's math):

1. on every bucket slice of this rank, AdamW on the rows that are no matrix's (the same kernels and
   bits as ShardedAdamW), and the Nesterov momentum on the matrices' rows, into a scratch row;
2. the matrices' pieces to their owners, Newton-Schulz once per matrix there, the results back
   (engine/matrix_owners.py: two all-to-all(v)s over the shard group; stage 0: every rank, locally);
3. on every bucket slice, the master of the matrices' rows moved by the result, the stored
   parameters written, and the bucket handed on (``after``: the engine's publish).

Every operation but NS is elementwise and NS runs on the whole matrix, so the bits do not depend on
the stage or on how the buckets are sliced. Offload and the update in the backward are refused
(engine/config.py): they update a bucket at a time, before the other buckets' matrices are known.
"""
import time

import numpy as np

from ..comm.simulated_world import simulated
from ..errors import ConfigError
from ..optim import impl
from ..optim.muon import apply_update, momentum_update, newton_schulz, shape_scale
from .decay import pieces
from .matrix_owners import exchange_bytes, from_owners, muon_names, own_runs, plan, to_owners
from .optimizer import ShardedAdamW

F32 = np.float32


class ShardedMuon(ShardedAdamW):
    """Muon on the matrices, AdamW on the rest, over this rank's rows; ``group``: the shard group."""

    name = "muon"
    state = ("momentum", "exp_avg", "exp_avg_sq")

    def __init__(self, layout, config, ledger, slot: int, rank: int, transfers=None, group=None):
        if group is not None and simulated(group):
            raise ConfigError("optimizer='muon' is not available on a simulated world yet (its stand-in ranks "
                              "mirror this one's shard, not the matrices its owners send); use adamw")
        super().__init__(layout, config, ledger, slot, rank, transfers)
        self.group = group
        slots = 1 if config.stage == 0 else layout.world_size
        stacked = config.muon_stacked
        self.matrices = plan(layout, muon_names({n: p.shape for n, p in layout.params.items()}, config.muon_params,
                                                stacked), config.stage, slots, stacked)
        self.runs = own_runs(self.matrices, 0 if config.stage == 0 else slot)
        self.scales = [shape_scale(m.shape) for m in self.matrices]
        self._u = ledger.alloc("buffers", self.n, F32)     # the momentum's Nesterov update, then NS's result
        self.seconds = {"newton_schulz": 0.0, "exchange": 0.0}   # this rank's, summed over the steps
        self.steps, self.sent = 0, 0     # orthogonalisations done, and the bytes their exchanges sent
        self.me = 0 if config.stage == 0 else slot    # the owner slot this rank is
        self._step = 0

    def scalars(self, lr, step: int, grad_scale: float):
        self._step = step                # the watchdog names the step an exchange waits in
        return super().scalars(lr, step, grad_scale)

    def figures(self) -> dict:
        """This rank's Muon figures: its matrices, the exchange's bytes per step measured beside the plan's."""
        per = lambda v: None if not self.steps else v / self.steps     # noqa: E731
        return {"matrices": len(self.matrices), "owned": sum(m.owner == self.me for m in self.matrices),
                "exchange_bytes_per_step": per(self.sent),
                "exchange_bytes_formula": 0 if self.config.stage == 0 else exchange_bytes(self.matrices, self.me),
                "newton_schulz_s_per_step": per(self.seconds["newton_schulz"]),
                "exchange_s_per_step": per(self.seconds["exchange"])}

    def update(self, sl, grad, param_out, s, background: bool = False) -> None:
        """Stage 0 (the whole model): :meth:`step` on the one part."""
        self.step([(sl, grad, param_out)], s)

    def step(self, parts, s, after=None) -> None:
        parts = [(slice(*sl.indices(self.n)[:2]), g, out) for sl, g, out in parts]
        for sl, grad, param_out in parts:
            self._elementwise(sl, grad, param_out, s)
        self._orthogonalise()
        for i, (sl, _, param_out) in enumerate(parts):
            self._apply(sl, param_out, s)
            if after is not None:
                after(i)

    # ---- the three passes ----------------------------------------------------------------
    def _split(self, sl):
        """``(lo, hi, matrix index or None)`` covering rows ``[sl.start, sl.stop)`` in order."""
        at = sl.start
        for a, z, i in self.runs:
            if z <= at or a >= sl.stop:
                continue
            if a > at:
                yield at, a, None
            yield max(a, at), min(z, sl.stop), i
            at = min(z, sl.stop)
        if at < sl.stop:
            yield at, sl.stop, None

    def _elementwise(self, sl, grad, param_out, s) -> None:
        rows = self.rows
        mom, u = rows.read("momentum"), self._u
        for lo, hi, i in self._split(sl):
            g = grad[lo - sl.start:hi - sl.start]
            if i is None:
                self._adamw(impl.adamw_update, slice(lo, hi), rows.read("master", slice(lo, hi)),
                            rows.read("exp_avg", slice(lo, hi)), rows.read("exp_avg_sq", slice(lo, hi)), g,
                            param_out[lo - sl.start:hi - sl.start], s)
            else:
                momentum_update(mom[lo:hi], g, s.grad_scale, self.config.muon_momentum, u[lo:hi])

    def _orthogonalise(self) -> None:
        t0 = time.perf_counter()
        self.steps += 1
        if self.config.stage == 0:
            for m in self.matrices:
                p = m.pieces[0]
                self._u[p.row:p.row + p.numel] = newton_schulz(self._u[p.row:p.row + p.numel].reshape(m.shape)
                                                               ).reshape(-1)
            self.seconds["newton_schulz"] += time.perf_counter() - t0
            return
        host = impl.to_host(self._u)
        tally = []
        mine = to_owners(self.group, self.matrices, host, self._step, tally)
        t1 = time.perf_counter()
        xp = impl.array_module(self._u)
        results = {n: impl.to_host(newton_schulz(xp.asarray(u))) for n, u in mine.items()}
        t2 = time.perf_counter()
        from_owners(self.group, self.matrices, results, host, self._step, tally)
        self.sent += sum(tally)
        if host is not self._u:
            self._u[...] = xp.asarray(host)
        self.seconds["newton_schulz"] += t2 - t1
        self.seconds["exchange"] += time.perf_counter() - t2 + t1 - t0

    def _apply(self, sl, param_out, s) -> None:
        master, o = self.rows.read("master"), self._u
        for lo, hi, i in self._split(sl):
            if i is None:
                continue
            for a, z, decays in pieces(self.no_decay, lo, hi):
                wd = s.weight_decay if decays else F32(0.0)
                apply_update(master[lo + a:lo + z], o[lo + a:lo + z], s.lr, self.scales[i], wd,
                             param_out[lo - sl.start + a:lo - sl.start + z])
