"""The sharded optimizer state: the fp32 master and the AdamW moments of this rank's shard.

Stage 0 keeps them for the whole model, stages 1-3 for this rank's slice of every bucket
(the shard, in bucket order). :class:`ShardedAdamW` fills the master from the caller's
initial arrays, updates one bucket's slice at a time (through ``optim.impl``: the fused
kernel or the NumPy reference, same bits), and gathers the whole master for a caller
that asks for the parameters by name.
"""
from typing import Optional

import numpy as np

from ..optim import impl
from ..optim.reference import AdamWScalars, adamw_scalars

F32 = np.float32


class ShardedAdamW:
    """``master``, ``exp_avg``, ``exp_avg_sq``: fp32 arrays of the shard (stage 0: the whole model),
    counted under "optimizer" in the ledger."""

    def __init__(self, layout, config, ledger, slot: int):
        self.layout, self.config, self.slot = layout, config, slot     # the slice of every bucket this rank holds
        n = layout.numel if config.stage == 0 else layout.shard_numel
        self.master = ledger.alloc("optimizer", n, F32)
        self.exp_avg = ledger.alloc("optimizer", n, F32)
        self.exp_avg_sq = ledger.alloc("optimizer", n, F32)

    def load_initial(self, pairs, xp) -> None:
        """Fill the master from the caller's arrays (``pairs``: [(layer, {name: array})]); each
        rank keeps only its slice of every bucket (stage 0: everything)."""
        lay = self.layout
        if self.config.stage == 0:
            full = np.zeros(lay.numel, F32)
            for _, params in pairs:
                for pname, arr in params.items():
                    pr = lay.params[pname]
                    full[pr.start:pr.stop] = np.asarray(arr, dtype=F32).reshape(-1)
            self.master[...] = xp.asarray(full)
            return
        for _, params in pairs:
            for pname, arr in params.items():
                pr = lay.params[pname]
                values = np.asarray(arr, dtype=F32).reshape(-1)
                b = lay.buckets[pr.bucket]
                lo, hi = b.slice_bounds(self.slot)
                a, z = max(lo, pr.bucket_offset), min(hi, pr.bucket_offset + pr.numel)
                if a < z:
                    dst = b.shard_start + (a - lo)
                    self.master[dst:dst + (z - a)] = xp.asarray(values[a - pr.bucket_offset:z - pr.bucket_offset])

    def scalars(self, lr: Optional[float], step: int, grad_scale: float) -> AdamWScalars:
        """The constants of update number ``step``; ``lr`` None: the config's."""
        c = self.config
        return adamw_scalars(c.lr if lr is None else lr, c.beta1, c.beta2, c.eps, c.weight_decay, step, grad_scale)

    def update(self, sl, grad, param_out, s: AdamWScalars) -> None:
        """AdamW on the state rows ``[sl]`` from the reduced ``grad``; writes the new stored-dtype
        parameters into ``param_out``."""
        impl.adamw_update(self.master[sl], self.exp_avg[sl], self.exp_avg_sq[sl], grad, param_out, s)

    def gather(self, group, step: int) -> np.ndarray:
        """The whole padded fp32 master in world layout, as a NumPy array on every rank: an
        all-gather over the shard ``group`` (a collective), each rank's slice put at its slot."""
        lay = self.layout
        host = _to_numpy(self.master)
        if self.config.stage == 0:
            return host.copy()
        out = np.zeros(lay.numel, F32)
        for bucket in lay.buckets:
            k = bucket.slice_numel
            table = np.empty((len(group.slots), k), F32)
            with group.waiting("gather_master (fp32 all-gather)", (bucket.index, step)):
                group.mpi.Allgather(np.ascontiguousarray(host[bucket.shard_slice]), table)   # timed by the watchdog
            for g, s in enumerate(group.slots):
                out[bucket.start + s * k:bucket.start + (s + 1) * k] = table[g]
        return out

    def close(self) -> None:
        self.master = self.exp_avg = self.exp_avg_sq = None


def _to_numpy(arr) -> np.ndarray:
    return arr.get() if hasattr(arr, "get") else np.asarray(arr)
