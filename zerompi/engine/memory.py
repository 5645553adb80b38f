"""Per-rank memory: a ledger of what the engine allocated, and the ZeRO formulas beside it.

Categories: "params", "grads", "optimizer" (fp32 master + m + v) are the model states of
DESIGN.md's table; "secondary" is hpZ's node-local copy of the parameters (stage 3, counted
with the model states when it is on); "buffers" are transient (gradient staging buckets, stage-3 gathered
buckets, the micro-batch gradient accumulator of stages 0/1, communication scratch).
"""
from typing import Dict

CATEGORIES = ("params", "grads", "optimizer", "secondary", "buffers")
OPTIMIZER_BYTES = 12  # fp32 master + Adam m + Adam v, bytes per parameter


def theory_bytes(stage: int, numel: int, world_size: int, itemsize: int, shard_numel: int = None,
                 secondary: float = 0) -> Dict[str, int]:
    """Model-state bytes per rank by DESIGN.md's table.

    ``numel`` is Psi (pass the padded world length to get the exact figure the engine
    allocates); ``world_size`` the ranks one copy is sharded over (the shard group's size);
    ``shard_numel`` is the per-rank shard length (default numel / world_size, which is exact
    only when numel divides). ``secondary``: elements of hpZ's node-local copy (numel /
    node_size; 0 without hpZ, and then the row is left out).
    """
    n = world_size
    shard = shard_numel if shard_numel is not None else numel / n
    full_p = itemsize * numel
    shard_p = itemsize * shard
    rows = {
        0: (full_p, full_p, OPTIMIZER_BYTES * numel),
        1: (full_p, full_p, OPTIMIZER_BYTES * shard),
        2: (full_p, shard_p, OPTIMIZER_BYTES * shard),
        3: (shard_p, shard_p, OPTIMIZER_BYTES * shard),
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


def memory_report(ledger, layout, stage: int, group_size: int, itemsize: int, secondary_parts: int,
                  scratch: int) -> Dict[str, Dict[str, int]]:
    """An engine's bytes per rank: ``measured`` (its ledger's model states now), ``theory`` (the
    formula on Psi), ``theory_padded`` (on the padded layout), ``peak_buffers`` (the most transient
    bytes held at once, ``scratch``: the communicators' receive buffers, included).
    ``secondary_parts``: the node size when hpZ keeps a copy of 1/node_size of the parameters, else 0."""
    k = secondary_parts
    return {
        "measured": ledger.model_states(),
        "theory": theory_bytes(stage, layout.params_numel, group_size, itemsize, secondary=k and layout.params_numel / k),
        "theory_padded": theory_bytes(stage, layout.numel, group_size, itemsize, layout.shard_numel,
                                      secondary=k and layout.numel // k),
        "peak_buffers": {"bytes": ledger.peak["buffers"] + scratch},
    }


class MemoryLedger:
    """Counts bytes allocated per category, now and at peak. Allocation goes through it."""

    def __init__(self, xp):
        self.xp = xp
        self.current = dict.fromkeys(CATEGORIES, 0)   # bytes held now
        self.peak = dict.fromkeys(CATEGORIES, 0)      # largest bytes held at once
        self.peak_total = 0

    def alloc(self, category: str, numel: int, dtype, zero: bool = True):
        arr = (self.xp.zeros if zero else self.xp.empty)(int(numel), dtype=dtype)
        self._add(category, arr.nbytes)
        return arr

    def free(self, category: str, arr) -> None:
        self._add(category, -arr.nbytes)

    def _add(self, category: str, nbytes: int) -> None:
        self.current[category] += nbytes
        self.peak[category] = max(self.peak[category], self.current[category])
        self.peak_total = max(self.peak_total, sum(self.current.values()))

    def model_states(self) -> Dict[str, int]:
        names = ("params", "grads", "optimizer") + (("secondary",) if self.current["secondary"] else ())
        out = {k: self.current[k] for k in names}
        out["total"] = sum(out.values())
        return out
