"""Per-rank memory: a ledger of what the engine allocated, and the ZeRO formulas beside it.

Categories: "params", "grads", "optimizer" (fp32 master + the optimizer's rows: AdamW m + v) are the model states of
DESIGN.md's table; "secondary" is hpZ's node-local copy of the parameters (stage 3, counted
with the model states when it is on); "buffers" are transient (gradient staging buckets, stage-3 gathered
buckets, the micro-batch gradient accumulator of stages 0/1, communication scratch).
"""
from typing import Dict

import numpy as np

from .optimizers import bytes_per_param

CATEGORIES = ("params", "grads", "optimizer", "secondary", "buffers")
OPTIMIZER_BYTES = 12  # fp32 master + Adam m + Adam v, bytes per parameter


def theory_bytes(stage: int, numel: int, world_size: int, itemsize: int, shard_numel: int = None,
                 secondary: float = 0, optimizer_bytes: int = OPTIMIZER_BYTES) -> Dict[str, int]:
    """Model-state bytes per rank by DESIGN.md's table.

    ``numel`` is Psi (pass the padded world length to get the exact figure the engine
    allocates); ``world_size`` the ranks one copy is sharded over (the shard group's size);
    ``shard_numel`` is the per-rank shard length (default numel / world_size, which is exact
    only when numel divides). ``secondary``: elements of hpZ's node-local copy (numel /
    node_size; 0 without hpZ, and then the row is left out). ``optimizer_bytes``: per parameter, the
    master and the optimizer's state rows (engine/optimizers.py; AdamW's 12 by default).
    """
    n = world_size
    shard = shard_numel if shard_numel is not None else numel / n
    full_p = itemsize * numel
    shard_p = itemsize * shard
    rows = {
        0: (full_p, full_p, optimizer_bytes * numel),
        1: (full_p, full_p, optimizer_bytes * shard),
        2: (full_p, shard_p, optimizer_bytes * shard),
        3: (shard_p, shard_p, optimizer_bytes * shard),
    }[stage]
    out = {k: int(round(v)) for k, v in zip(("params", "grads", "optimizer"), rows)}
    if secondary:
        out["secondary"] = int(round(itemsize * secondary))
    out["total"] = sum(out.values())
    return out


def theory_comm_bytes(stage: int, numel: int, world_size: int, itemsize: int, micro_batches: int = 1) -> int:
    """Bytes one rank sends per optimizer step (ring-optimal volumes, (N-1)/N of the buffer per pass).

    Gradients are reduce-scattered once per micro-batch in every stage; stage 0 then
    all-gathers gradients (completing an all-reduce), stages 1/2 all-gather parameters,
    stage 3 all-gathers parameters twice per micro-batch (forward and backward).
    """
    n = world_size
    one_pass = itemsize * numel * (n - 1) // n
    if stage == 3:
        return micro_batches * 3 * one_pass
    return (micro_batches + 1) * one_pass


def memory_report(ledger, layout, config, group_size: int, itemsize: int, secondary_parts: int,
                  scratch: int) -> Dict[str, Dict[str, int]]:
    """An engine's bytes per rank: ``measured`` (its ledger's model states now), ``theory`` (the
    formula on Psi), ``theory_padded`` (on the padded layout), ``theory_by_place`` (that, split
    by where offload puts each row), ``peak_buffers`` (the most transient bytes held at once,
    ``scratch``: the communicators' receive buffers, included). ``secondary_parts``: the node
    size when hpZ keeps a copy of 1/node_size of the parameters, else 0."""
    k, stage = secondary_parts, config.stage
    opt = bytes_per_param(getattr(config, "optimizer", "adamw"))
    padded = theory_bytes(stage, layout.numel, group_size, itemsize, layout.shard_numel,
                          secondary=k and layout.numel // k, optimizer_bytes=opt)
    return {
        "measured": ledger.model_states(),
        "theory": theory_bytes(stage, layout.params_numel, group_size, itemsize,
                               secondary=k and layout.params_numel / k, optimizer_bytes=opt),
        "theory_padded": padded,
        "theory_by_place": theory_by_place(padded, config),
        "peak_buffers": {"bytes": ledger.peak["buffers"] + scratch},
    }


def theory_by_place(states: Dict[str, int], config) -> Dict[str, Dict[str, int]]:
    """Model-state bytes (theory_bytes) split into device / host / disk by the config's offload."""
    where = {"optimizer": {"none": "device", "cpu": "host", "nvme": "disk"}[config.offload_optimizer],
             "params": "disk" if config.offload_params == "nvme" else "device"}
    out = {p: {} for p in PLACES}
    for key, nbytes in states.items():
        if key != "total" and nbytes:
            out[where.get(key, "device")][key] = nbytes
    for row in out.values():
        row["total"] = sum(row.values())
    return out


PLACES = ("device", "host", "disk")   # the engine's array memory, offloaded host memory, files


class MemoryLedger:
    """Counts bytes allocated per category, now and at peak, and per place. Allocation goes through it.

    ``place``: "device" (the engine's array module: the GPU, or host memory on the CPU device),
    "host" (offloaded host memory: ``host_alloc`` makes the arrays) or "disk" (offload files:
    counted with :meth:`count`, nothing allocated)."""

    def __init__(self, xp, host_alloc=None):
        self.xp = xp
        self.host_alloc = host_alloc or (lambda n, dtype: np.zeros(n, dtype))   # pinned on a GPU
        self.current = dict.fromkeys(CATEGORIES, 0)   # bytes held now, every place
        self.peak = dict.fromkeys(CATEGORIES, 0)      # largest bytes held at once
        self.peak_total = 0
        self.places = {p: dict.fromkeys(CATEGORIES, 0) for p in PLACES}   # bytes held now, by place

    def alloc(self, category: str, numel: int, dtype, zero: bool = True, place: str = "device"):
        if place == "host":
            arr = self.host_alloc(int(numel), dtype)       # pinned memory comes uninitialized
            if zero:
                arr[...] = 0
        else:
            arr = (self.xp.zeros if zero else self.xp.empty)(int(numel), dtype=dtype)
        self._add(category, arr.nbytes, place)
        return arr

    def count(self, category: str, nbytes: int, place: str) -> None:
        """Bytes held elsewhere than in an array the ledger made (offload files: place "disk")."""
        self._add(category, nbytes, place)

    def free(self, category: str, arr, place: str = "device") -> None:
        self._add(category, -arr.nbytes, place)

    def _add(self, category: str, nbytes: int, place: str = "device") -> None:
        self.current[category] += nbytes
        self.places[place][category] += nbytes
        self.peak[category] = max(self.peak[category], self.current[category])
        self.peak_total = max(self.peak_total, sum(self.current.values()))

    def by_place(self) -> Dict[str, Dict[str, int]]:
        """{place: {category: bytes, "total": bytes}} of what is held now (categories with bytes only)."""
        out = {}
        for place, held in self.places.items():
            row = {k: v for k, v in held.items() if v}
            row["total"] = sum(row.values())
            out[place] = row
        return out

    def model_states(self) -> Dict[str, int]:
        names = ("params", "grads", "optimizer") + (("secondary",) if self.current["secondary"] else ())
        out = {k: self.current[k] for k in names}
        out["total"] = sum(out.values())
        return out
